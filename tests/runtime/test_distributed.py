"""Tensor parallelism across processes: real ranks under Open MPI's `mpirun` (CPU, gloo) serve the fixture
engine split over 2 and 4 ranks and give exactly the greedy tokens of `generate()` on the unsplit
(tp 1) checkpoint; followers stop when rank 0 closes and when rank 0 dies. Also the pure parts: where
ranks meet, the rank environment, the step messages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import REPO
from support.engines import MAX_NEW, build_tiny_engine, chat_prompts, unsplit_answers
from trtglm.backend.engine import ServedEngine
from trtglm.errors import UsageError
from trtglm.runtime.distributed import (COPY, DECODE, DECODE_TOKEN, MIXED, PREFILL, RELEASE, REUSE, STOP,
                                        LeaderSlotModel, RankInfo, Step, StepChannel, follow, rank_info, rendezvous,
                                        step_link_host)
from trtglm.runtime.model import load_model
from trtglm.runtime.step_link import COUNT, StepLink, _accept

# One rank's program: a ServedEngine from the OMPI environment; rank 0 answers the prompts (all submitted
# at once, so they are batched) and writes the tokens (mode "beams:W": every beam of a beam search W wide);
# every rank reports how it ended, then exits as a served rank's engine process does.
RANK_PROGRAM = '''
import json, os, sys, time
from trtglm.backend.engine import ServedEngine
from trtglm.request_config import SamplingConfig
from trtglm.runtime.distributed import rendezvous
from trtglm.runtime.request import Request

engine_dir, prompts_file, out_dir, mode = sys.argv[1:5]
engine = ServedEngine(engine_dir)
rank = engine.info.rank
inner = getattr(engine.model, "inner", engine.model)  # rank 0's model behind the steps it tells the others
report = {"rank": rank, "rendezvous": rendezvous(), "model": type(inner).__name__}
if rank == 0:
    if mode == "die":
        os._exit(0)  # rank 0 goes away without a word
    prompts = json.load(open(prompts_file))
    tokens = [[] for _ in prompts]
    width, new = (int(mode[6:]), 40) if mode.startswith("beams:") else (1, int(mode))

    def take(output, i):
        tokens[i].extend([b.tokens for b in output.beams] if output.beams else output.tokens)

    handles = [engine.executor.submit(Request(p, new, end_id=2, stop_words=[[518], [520]],
                                                      sampling=SamplingConfig(beam_width=width)),
                                      lambda output, i=i: take(output, i))
               for i, p in enumerate(prompts)]
    for handle in handles:
        handle.done.wait()
    stats = engine.executor.stats()
    report.update(tokens=tokens, max_decode_batch=stats.max_decode_batch, prefill_chunks=stats.prefill_chunks)
else:
    engine.follower.join(60)
    report["follower_alive"] = engine.follower.is_alive()
engine.close()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
os._exit(0)  # as the engine's process ends (backend/engine_process.py): no teardown of gloo's threads at exit
'''


def needs_mpirun() -> None:
    if subprocess.run(["sh", "-c", "command -v mpirun"], capture_output=True).returncode != 0:
        pytest.skip("mpirun (openmpi-bin) is not installed")


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("engines")
    return {tp: build_tiny_engine(root / f"tp{tp}", tp) for tp in (1, 2, 4)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return chat_prompts(every=4)


@pytest.fixture(scope="module")
def expected(engines, prompts) -> list[list[int]]:
    torch.set_num_threads(1)
    return unsplit_answers(engines[1] / "checkpoint", prompts)


def run_ranks(tmp_path: Path, engine: Path, world: int, prompts: list[list[int]], mode: str,
              timeout: float = 120, runtime: str = "auto") -> dict[int, dict]:
    program, prompts_file = tmp_path / "rank.py", tmp_path / "prompts.json"
    program.write_text(RANK_PROGRAM)
    prompts_file.write_text(json.dumps(prompts))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRTGLM_RUNTIME": runtime}
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH",
               "-x", "PATH", "-x", "OMP_NUM_THREADS", "-x", "TRTGLM_RUNTIME", "-n", str(world), sys.executable,
               str(program), str(engine), str(prompts_file), str(tmp_path), mode]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert reports, f"no rank reported (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    reports[-1] = {"stderr": proc.stderr, "returncode": proc.returncode}
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_in_processes_give_the_tokens_of_the_unsplit_model(tmp_path, engines, prompts, expected, world):
    needs_mpirun()
    reports = run_ranks(tmp_path, engines[world], world, prompts, str(MAX_NEW))
    assert reports[-1]["returncode"] == 0, reports[-1]["stderr"]
    assert reports[0]["tokens"] == expected
    assert len(prompts) > 8 and reports[0]["max_decode_batch"] == 8  # every slot busy, the rest queued
    assert all(reports[r]["follower_alive"] is False for r in range(1, world))  # rank 0's close stopped them
    meeting_place = reports[0]["rendezvous"]
    assert meeting_place.startswith("file://") and not Path(meeting_place[len("file://"):]).exists()  # removed


@pytest.mark.slow
def test_fast_runtime_ranks_in_processes_give_the_tokens_of_the_unsplit_model(tmp_path, engines, prompts, expected):
    """The fast runtime (opted into on the CPU: its torch ops) at tp 2: each rank a `FastModel` of its own shard,
    rank 0's executor leading, the follower making its steps; the tokens are the unsplit portable model's."""
    needs_mpirun()
    reports = run_ranks(tmp_path, engines[2], 2, prompts, str(MAX_NEW), runtime="fast")
    assert reports[-1]["returncode"] == 0, reports[-1]["stderr"]
    assert reports[0]["tokens"] == expected
    assert reports[0]["model"] == reports[1]["model"] == "FastModel"
    assert reports[0]["max_decode_batch"] == 8 and reports[1]["follower_alive"] is False


@pytest.mark.slow
def test_ranks_in_processes_prefill_prompts_in_chunks(tmp_path, prompts, expected):
    """A prefill budget of 16 tokens a step (the engine's max_num_tokens): every rank continues the same slots
    from the same starts, and the tokens are still those of the unsplit model."""
    needs_mpirun()
    engine = build_tiny_engine(tmp_path / "engine", 2, **{"build.max_num_tokens": 16,
                                                          "build.use_paged_context_fmha": True})
    reports = run_ranks(tmp_path, engine, 2, prompts, str(MAX_NEW))
    assert reports[-1]["returncode"] == 0, reports[-1]["stderr"]
    assert reports[0]["tokens"] == expected
    assert max(map(len, prompts)) > 16 and reports[0]["prefill_chunks"] > len(prompts)
    assert reports[0]["max_decode_batch"] > 1  # decode tokens and prompt chunks share each step's 16 tokens


@pytest.mark.slow
def test_ranks_in_processes_search_beams_like_the_unsplit_model(tmp_path, prompts):
    """Beam searches across two ranks: every rank copies the same slots as beams move on (rank 0's copy steps),
    and the beams are those of the unsplit model's in-process search."""
    from trtglm.runtime.generate import beam_search

    needs_mpirun()
    engine = build_tiny_engine(tmp_path / "engine", 2, **{"build.max_beam_width": 2})
    reports = run_ranks(tmp_path, engine, 2, prompts[:6], "beams:2")
    assert reports[-1]["returncode"] == 0, reports[-1]["stderr"]
    torch.set_num_threads(1)
    model = load_model(engine / "checkpoint")
    for prompt, beams in zip(prompts[:6], reports[0]["tokens"], strict=True):
        alone = beam_search(model, prompt, 2, 40, end_id=2, stop_words=[[518], [520]])
        assert beams == [b.tokens[:-1] if b.tokens[-1] == 2 else b.tokens for b in alone]
    assert len({tuple(beams[1]) for beams in reports[0]["tokens"]}) > 1


@pytest.mark.slow
def test_followers_stop_when_rank_0_dies(tmp_path, engines, prompts):
    needs_mpirun()
    reports = run_ranks(tmp_path, engines[2], 2, prompts, "die")
    assert 0 not in reports and reports[1]["follower_alive"] is False
    assert "rank 0 went away" in reports[-1]["stderr"]
    Path(reports[1]["rendezvous"][len("file://"):]).unlink(missing_ok=True)  # what the dead rank 0 left


def test_rank_info_comes_from_open_mpi_or_pmix():
    assert rank_info({}) == RankInfo(0, 1, 0, 1)
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert rank_info(env) == RankInfo(3, 4, 1, 2)
    assert rank_info({"PMIX_RANK": "1", "PMIX_SIZE": "2"}) == RankInfo(1, 2, 1, 2)
    with pytest.raises(UsageError, match="rank 4 is outside the world size 4"):
        rank_info({**env, "OMPI_COMM_WORLD_RANK": "4"})
    with pytest.raises(UsageError, match="must be a whole number"):
        rank_info({"OMPI_COMM_WORLD_SIZE": "two"})


def test_ranks_meet_through_master_env_or_a_file_named_by_the_launch():
    assert rendezvous({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TRTGLM_LAUNCH_ID": "ab"}) == "env://"
    one = rendezvous({"TRTGLM_LAUNCH_ID": "1a2b3c4d", "PMIX_NAMESPACE": "960364545"})
    assert one.startswith("file:///") and one.endswith("trtglm-ranks-1a2b3c4d-960364545")
    assert rendezvous({"TRTGLM_LAUNCH_ID": "1a2b3c4d", "PMIX_NAMESPACE": "960364546"}) != one  # another mpirun
    assert rendezvous({"OMPI_MCA_ess_base_jobid": "77"}).endswith("trtglm-ranks-77")
    with pytest.raises(UsageError, match="MASTER_ADDR and MASTER_PORT"):
        rendezvous({})


def test_prefill_steps_carry_each_prompt_and_where_it_starts():
    step = Step.prefill([2, 0], [[5, 6, 7], [9]])
    assert (step.op, step.slots, step.data) == (PREFILL, [2, 0], [0, 0, 3, 1, 5, 6, 7, 9])
    chunked = Step.prefill([2, 0], [[5, 6, 7], [9]], starts=[4, 0])
    assert chunked.data == [4, 0, 3, 1, 5, 6, 7, 9]
    received = Step(chunked.op, chunked.slots, chunked.data)
    assert received.prompts() == [[5, 6, 7], [9]] and received.starts() == [4, 0]
    # A mixed step's decode tokens come first, their ids apart (on the device); the prompts' ids follow.
    mixed = Step.prefill([3, 1, 0], [None, None, [5, 6]], starts=[7, 2, 0], op=MIXED, tokens=torch.tensor([8, 9]))
    assert mixed.data == [7, 2, 0, DECODE_TOKEN, DECODE_TOKEN, 2, 5, 6] and mixed.tokens.tolist() == [8, 9]
    assert Step(MIXED, mixed.slots, mixed.data).prompts() == [None, None, [5, 6]]
    with pytest.raises(UsageError, match="2 prompts but 1 starts"):
        Step.prefill([2, 0], [[5, 6, 7], [9]], starts=[4])


class Script:
    """A channel that hands out rank 0's steps from a list (then stops), and a model that records its calls."""

    def __init__(self, steps: list[Step]):
        self.steps, self.calls = list(steps), []
        self.vocab_size, self.num_slots, self.max_seq_len, self.kv_tokens = 10, 2, 8, 16

    def receive(self) -> Step:
        return self.steps.pop(0) if self.steps else Step(STOP, [], [])

    def prefill(self, slots, prompts, starts=None):
        self.calls.append(("prefill", list(slots), [list(p) for p in prompts], list(starts)))

    def decode(self, slots, tokens):
        if tokens.tolist() == [99]:
            raise UsageError("token id 99 is outside the vocabulary")  # as rank 0's shard refused it too
        self.calls.append(("decode", list(slots), tokens.tolist()))

    def step(self, slots, pieces, starts, decode_ids=None):
        self.calls.append(("step", list(slots), [p and list(p) for p in pieces], list(starts),
                           None if decode_ids is None else decode_ids.tolist()))

    def prefill_all(self, slot, chunk, start=0):
        self.calls.append(("prefill_all", slot, list(chunk), start))

    def reuse(self, slot, source, length):
        self.calls.append(("reuse", slot, source, length))

    def release(self, slot, keep=0):
        self.calls.append(("release", slot, keep))

    def copy(self, sources, targets):
        self.calls.append(("copy", list(sources), list(targets)))


def test_a_follower_makes_rank_0s_calls_and_goes_on_after_one_that_fails():
    script = Script([Step.prefill([1], [[4, 5]]), Step(DECODE, [1], [], torch.tensor([99])),
                     Step(DECODE, [1], [], torch.tensor([6])), Step(COPY, [0], [1]), Step(RELEASE, [1], [8]),
                     Step(DECODE, [0], [], torch.tensor([3]))])
    script.steps.insert(5, Step(STOP, [], []))  # rank 0 stops: what follows is never made
    follow(script, script)
    assert script.calls == [("prefill", [1], [[4, 5]], [0]), ("decode", [1], [6]), ("copy", [1], [0]),
                            ("release", 1, 8)]


def test_the_leader_sends_a_copy_before_making_it():
    script = Script([])
    sent = []
    leader = LeaderSlotModel(script, type("Channel", (), {"send": lambda self, step: sent.append(step)})())
    leader.copy([2, 2], [0, 1])
    assert sent == [Step(COPY, [0, 1], [2, 2])] and script.calls == [("copy", [2, 2], [0, 1])]


def test_a_follower_makes_rank_0s_mixed_steps_prefix_copies_and_prefills_keeping_every_logit():
    script = Script([Step(REUSE, [1], [0, 4]), Step.prefill([0, 1], [[7], [4, 5]], [6, 4], op=MIXED)])
    sent = []
    leader = LeaderSlotModel(script, type("Channel", (), {"send": lambda self, step: sent.append(step)})())
    leader.prefill_all(0, [8, 9], 3)
    leader.step([2, 1], [None, [4, 5]], [6, 4], decode_ids=torch.tensor([7]))
    script.steps += sent
    follow(script, script)
    assert script.calls == [("prefill_all", 0, [8, 9], 3), ("step", [2, 1], [None, [4, 5]], [6, 4], [7]),
                            ("reuse", 1, 0, 4), ("step", [0, 1], [[7], [4, 5]], [6, 4], None),
                            ("prefill_all", 0, [8, 9], 3), ("step", [2, 1], [None, [4, 5]], [6, 4], [7])]


STEPS = [Step(DECODE, [0, 3, 1], [], torch.tensor([7, 8, 9])),
         Step.prefill([2, 0, 1], [None, [5, 6, 7], [9] * 5000], starts=[4, 0, 2], op=MIXED, tokens=torch.tensor([3])),
         Step(RELEASE, [1], [8]), Step(STOP, [], [])]


def tokens_of(steps: list[Step]) -> list[list[int] | None]:
    return [None if s.tokens is None else s.tokens.tolist() for s in steps]


def test_steps_cross_the_link_whole_one_message_each():
    """On the CPU a step's header, slots, numbers and decode tokens go as one message over a real socket;
    what a follower receives is what rank 0 sent."""
    import threading

    leader_end, follower_end = socket.socketpair()
    sent_messages = []
    leader = StepChannel(StepLink([leader_end]), None, torch.device("cpu"))
    follower = StepChannel(StepLink([follower_end]), None, torch.device("cpu"))
    send = leader.link.send
    leader.link.send = lambda numbers: (sent_messages.append(len(numbers)), send(numbers))
    sending = threading.Thread(target=lambda: [leader.send(step) for step in STEPS])  # a long one fills the buffer
    sending.start()
    received = [follower.receive() for _ in STEPS]
    sending.join()
    assert received == STEPS and tokens_of(received) == tokens_of(STEPS)
    assert len(sent_messages) == len(STEPS)
    leader_end.close()
    with pytest.raises(RuntimeError, match="rank 0 closed the step link"):
        follower.receive()
    follower_end.close()


LINK_PROGRAM = '''
import json, logging, sys, torch
from trtglm.runtime.distributed import RankInfo, Step, join
logging.basicConfig(level=logging.INFO)  # the step link says which way it goes
rank, world, meeting, steps_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
local = int(sys.argv[6])  # ranks on this rank's host: all of them, or one (each on a host of its own)
joined = join(RankInfo(rank, world, rank if local == world else 0, local), torch.device("cpu"), init_method=meeting)
channel = joined.steps(torch.device("cpu"))
channel.tokens_in_message = False  # as on a GPU: the tokens over the compute group
if rank == 0:
    for op, slots, data, tokens in json.load(open(steps_file)):
        channel.send(Step(op, slots, data, None if tokens is None else torch.tensor(tokens)))
else:
    received = [channel.receive() for _ in json.load(open(steps_file))]
    json.dump([[s.op, s.slots, s.data, None if s.tokens is None else s.tokens.tolist()] for s in received],
              open(out, "w"))
joined.close()
'''


@pytest.mark.slow
@pytest.mark.parametrize("local", [3, 1], ids=["one-host", "a-host-each"])
def test_ranks_meet_on_the_step_link_and_each_follower_gets_every_step(tmp_path, local):
    """Three processes join the groups and the step link (its folder gone once they have): a Unix socket when they
    share a host, TCP to MASTER_ADDR when each says it has a host of its own; each follower receives rank 0's steps
    whole, the decode tokens over the compute group as on a GPU."""
    program, steps_file = tmp_path / "link.py", tmp_path / "steps.json"
    program.write_text(LINK_PROGRAM)
    steps = [[s.op, s.slots, s.data, tokens] for s, tokens in zip(STEPS, tokens_of(STEPS))]
    steps_file.write_text(json.dumps(steps))
    meeting, env = (tmp_path / "meeting").as_uri(), {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                     "MASTER_ADDR": "127.0.0.1"}
    before = set(Path(tempfile.gettempdir()).glob("trtglm-steps-*"))
    ranks = [subprocess.Popen([sys.executable, str(program), str(rank), "3", meeting, str(steps_file),
                               str(tmp_path / f"{rank}.json"), str(local)], env=env, stderr=subprocess.PIPE, text=True)
             for rank in range(3)]
    errors = [rank.communicate(timeout=120)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0, 0], errors
    for follower in (1, 2):
        assert json.loads((tmp_path / f"{follower}.json").read_text()) == steps
    assert set(Path(tempfile.gettempdir()).glob("trtglm-steps-*")) == before
    assert ("over TCP" in errors[0]) == (local == 1)


def test_a_tcp_step_link_takes_only_followers_that_say_its_secret():
    import threading

    secret = b"s" * 16
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def join(rank: int, said: bytes) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(COUNT.pack(rank) + said)
            return sock

        stranger, follower = join(1, b"x" * 16), None
        accepted = []
        taking = threading.Thread(target=lambda: accepted.extend(_accept(server, 2, secret)))
        taking.start()
        follower = join(1, secret)
        taking.join(10)
        assert len(accepted) == 1 and accepted[0].getpeername() == follower.getsockname()
        assert stranger.recv(1) == b""  # closed on it
        for sock in (stranger, follower, *accepted):
            sock.close()


def test_ranks_on_several_hosts_link_to_rank_0s_host_and_on_one_host_by_a_unix_socket():
    assert step_link_host(RankInfo(0, 2, 0, 2), {}) is None
    assert step_link_host(RankInfo(1, 4, 1, 2), {"MASTER_ADDR": "leader.lws"}) == "leader.lws"
    with pytest.raises(UsageError, match="span hosts .* need MASTER_ADDR and MASTER_PORT"):
        step_link_host(RankInfo(1, 2, 0, 1), {})


def test_the_leader_tells_a_decode_step_without_waiting_for_its_tokens():
    """The decode tokens' ids go to the followers as the tensor the token choice left (on the device), never
    brought to the host; ids given as a list are sent as a tensor on the channel's device."""
    script, sent = Script([]), []
    channel = type("Channel", (), {"send": lambda self, step: sent.append(step), "device": torch.device("cpu")})()
    leader = LeaderSlotModel(script, channel)
    chosen = torch.tensor([4, 2])
    leader.decode([0, 1], chosen)
    leader.decode([1], [6])
    assert [(s.op, s.slots, s.data) for s in sent] == [(DECODE, [0, 1], []), (DECODE, [1], [])]
    assert sent[0].tokens is chosen and sent[1].tokens.tolist() == [6] and sent[1].tokens.dtype == torch.int64
    assert script.calls == [("decode", [0, 1], [4, 2]), ("decode", [1], [6])]


def test_a_rank_process_holds_only_its_own_shard(engines):
    from safetensors.torch import load_file

    model = load_model(engines[2] / "checkpoint", rank=1)
    assert [r.rank for r in model.ranks] == [1]
    stored = load_file(str(engines[2] / "checkpoint" / "rank1.safetensors"))
    assert torch.equal(model.ranks[0].lm_head, stored["lm_head.weight"])
    assert torch.equal(model.ranks[0].layers[2].qkv, stored["transformer.layers.2.attention.qkv.weight"])
    with pytest.raises(UsageError, match="rank 2 is outside the checkpoint's world size 2"):
        load_model(engines[2] / "checkpoint", rank=2)


def test_a_world_that_does_not_match_the_engine_is_refused(engines):
    with pytest.raises(UsageError, match=r"1 rank\(s\) serve an engine of tp × pp = 2 .* --world-size 2"):
        ServedEngine(engines[2], info=RankInfo(0, 1, 0, 1))
