"""Each kind of process of a launch killed with SIGKILL under streams, at world sizes 1 and 2, on a real
launched server of the fixture's engine (CPU): tritonserver's python stubs of each model, the engine process
of rank 0 and of rank 1, a whole rank's tritonserver, the OpenAI API's process.

Every such death stops the whole launch (serve/stubs.py says why none is healed), so each kill has a launch
of its own. In flight at the kill: long streams on every client path (ensemble HTTP SSE, tensorrt_llm_bls gRPC
streaming, OpenAI chat streaming): the long ones fill the engine's slots and its queue, and the OpenAI ones
wait in the queue too, sent once each long path has streamed a piece; the kill comes QUEUED_S after every
stream was sent (at once if a long stream is halfway through its answer by then: a slow machine).
Asserted, timed from the kill: every stream has ended within BOUND_S, with an error event, an error response
or a closed connection (or, one that the death did not touch, with its whole answer); Triton's
/v2/health/ready, the ensemble's readiness and the OpenAI API's /health stop answering 200 within HEALTH_BOUND_S and
never answer 200 again; and the launch is gone whole: no process, no shared-memory segment, no state file,
no zombie, and `trtglm status` lists nothing.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from conftest import repo_processes
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.servers import NO_PROXY, Server

from trtglm.serve.openai_process import API_MODULE

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

BOUND_S = 5.0  # the requirement: every affected request has its error this soon
HEALTH_BOUND_S = 0.5  # and health answers no 200 after this
GONE_S = 30.0  # the whole launch stopped (generous: a loaded 2-core machine)
STUB = "triton_python_backend_stub"
PROMPT = "What is the capital of France?"
LONG = {"max_tokens": 480, "min_length": 480, "bad_words": ["<|user|>", "<|observation|>"]}  # never stops early
LONG_ANSWER = 400  # characters at least in LONG's answer
STREAMS = {"ensemble-sse": 6, "bls-grpc": 6, "openai": 2}  # 12 long ones: the fixture engine has 8 slots
QUEUED_S = 0.3  # for the OpenAI streams to reach the engine's queue
CHAT = {"model": "tiny", "temperature": 0, "stream": True, "messages": [{"role": "user", "content": PROMPT}]}

# (world size, what is killed, its rank): each kind at both world sizes
KILLS = [(world, what, rank) for world in (1, 2) for what, rank in (
    ("stub:preprocessing", 0), ("stub:tensorrt_llm", 0), ("stub:postprocessing", 0), ("stub:tensorrt_llm_bls", 0),
    ("engine", 0), ("openai", 0))] + [
    (1, "tritonserver", 0), (2, "stub:tensorrt_llm", 1), (2, "engine", 1), (2, "tritonserver", 1)]


@dataclass
class Outcome:
    """How one stream ended, timed by time.monotonic()."""

    pieces: list[str] = field(default_factory=list)
    how: str | None = None  # "error" (an error event or response), "closed" (the connection), "complete"
    detail: str = ""
    ended: float | None = None

    def end(self, how: str, detail: str = "") -> None:
        if self.how is None:
            self.how, self.detail, self.ended = how, detail[:200], time.monotonic()


class Stream(threading.Thread):
    """One streamed request; `sent` is set once it was sent, `started` at its first piece."""

    def __init__(self, server: Server, path: str):
        super().__init__(daemon=True, name=path)
        self.server, self.path = server, path
        self.outcome = Outcome()
        self.sent, self.started = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            {"ensemble-sse": self._sse, "bls-grpc": self._grpc, "openai": self._openai}[self.path]()
        except (OSError, http.client.HTTPException, httpx.HTTPError) as e:
            self.outcome.end("closed", f"{type(e).__name__}: {e}")
        except Exception as e:  # the client broke: the test fails on it
            self.outcome.end("client", f"{type(e).__name__}: {e}")
        finally:
            self.sent.set()
            self.started.set()

    def _piece(self, text: str) -> None:
        self.outcome.pieces.append(text)
        self.started.set()

    def _sse(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        connection.request("POST", "/v2/models/ensemble/generate_stream",
                           json.dumps({"text_input": PROMPT, "stream": True, **LONG}),
                           {"Content-Type": "application/json"})
        self.sent.set()
        try:
            for line in connection.getresponse():
                if line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        return self.outcome.end("error", event["error"])
                    self._piece(event["text_output"])
        finally:
            connection.close()
        self.outcome.end("complete" if "".join(self.outcome.pieces) == self.server.long_answer else "closed")

    def _grpc(self) -> None:
        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=60)
        try:
            client.async_stream_infer("tensorrt_llm_bls", grpc_inputs(grpc), enable_empty_final_response=True)
            self.sent.set()
            while True:
                result, error = answers.get(timeout=60)
                if error is not None:
                    return self.outcome.end("error", str(error))
                text = result.as_numpy("text_output")
                if text is not None:
                    self._piece(b"".join(text.reshape(-1)).decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return self.outcome.end("complete" if "".join(self.outcome.pieces) == self.server.long_answer
                                            else "wrong")
        finally:  # stop_stream waits for the requests it cancels: never on this thread
            threading.Thread(target=lambda: (client.stop_stream(cancel_requests=True), client.close()),
                             daemon=True).start()

    def _openai(self) -> None:
        # Sent when the request goes, not when its response starts: the API answers its headers with the first
        # token, which a request queued behind the long streams gets only when they are nearly done.
        sent_hook = {"request": [lambda _: self.sent.set()]}
        with httpx.Client(trust_env=False, timeout=60, event_hooks=sent_hook) as http, \
                http.stream("POST", f"http://127.0.0.1:{self.server.openai_port}/v1/chat/completions",
                            json=CHAT) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return self.outcome.end("error", event["error"]["message"])
                self.outcome.pieces.append(event["choices"][0]["delta"].get("content") or "")
        self.outcome.end("complete" if "".join(self.outcome.pieces) == "The capital of France is Paris."
                         else "closed")


def wait_for_the_kill_moment(long_ones: list[Stream], queued: list[Stream], halfway: int, limit_s: float = 60):
    """Once each long path has streamed a piece, start the queued streams (they wait in the engine's queue
    behind the long ones); return when every stream was sent, QUEUED_S later, or as soon as every stream was
    sent once a long stream has `halfway` characters of its answer: on a slow machine the set-up must not
    outlast the streams it is for."""
    deadline, all_sent = time.monotonic() + limit_s, None
    while True:
        past_halfway = any(answered(stream) >= halfway for stream in long_ones)
        if queued[0].ident is None and (past_halfway or all(any(s.started.is_set() for s in long_ones if s.path == path)
                                                            for path in ("ensemble-sse", "bls-grpc"))):
            for stream in queued:
                stream.start()
        if all_sent is None and all(stream.sent.is_set() for stream in long_ones + queued):
            all_sent = time.monotonic()
        if all_sent is not None and (past_halfway or time.monotonic() >= all_sent + QUEUED_S):
            return
        assert time.monotonic() < deadline, [(s.name, s.sent.is_set(), s.started.is_set()) for s in long_ones + queued]
        time.sleep(0.02)


def answered(stream: Stream) -> int:
    return sum(map(len, list(stream.outcome.pieces)))


def grpc_inputs(grpc) -> list:
    arrays = {"text_input": np.array([[PROMPT.encode()]], np.object_),
              "max_tokens": np.array([[LONG["max_tokens"]]], np.int32),
              "min_length": np.array([[LONG["min_length"]]], np.int32), "stream": np.array([[True]], np.bool_),
              "bad_words": np.array([[w.encode() for w in LONG["bad_words"]]], np.object_)}
    types = {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL"}
    tensors = []
    for name, array in arrays.items():
        tensor = grpc.InferInput(name, list(array.shape), types[array.dtype.type])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


class HealthWatch:
    """Each health URL asked every 20 ms by a thread of its own: when a check that got 200 was sent (its answer
    can be read late: this process runs every stream's thread too)."""

    def __init__(self, server: Server):
        http, openai = f"http://127.0.0.1:{server.http_port}", f"http://127.0.0.1:{server.openai_port}"
        self.urls = [f"{http}/v2/health/ready", f"{http}/v2/models/ensemble/ready", f"{openai}/health"]
        self.seen: list[tuple[float, str, bool]] = []  # (time.monotonic() when sent, url, 200)
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.watch, args=(url,), daemon=True) for url in self.urls]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def watch(self, url: str) -> None:
        while not self.done.wait(0.02):
            sent = time.monotonic()
            self.seen.append((sent, url, answers_200(url)))

    def last_200(self, url: str) -> float | None:
        return max((at for at, seen_url, ok in self.seen if seen_url == url and ok), default=None)


def answers_200(url: str) -> bool:
    try:
        with NO_PROXY.open(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def victim(repo: Path, what: str, rank: int) -> psutil.Process:
    """The one process of the launch of `repo` that `what` names, on `rank`."""
    marker = f"_rank{rank}_"
    found = []
    for proc in repo_processes(repo) + [child for p in repo_processes(repo) for child in children(p)]:
        try:
            args, parent = proc.cmdline(), proc.parent()
            parent_args = parent.cmdline() if parent else []
        except psutil.Error:
            continue
        if what.startswith("stub:"):
            hit = os.path.basename(args[0]) == STUB and Path(args[1]).parent.parent.name == what[5:] \
                and any(marker in a for a in args)
        elif what == "engine":
            hit = "trtglm.backend.engine_process" in args and any(marker in a for a in parent_args)
        elif what == "tritonserver":
            hit = proc.name() == "tritonserver" and any(marker in a for a in args)
        else:
            hit = API_MODULE in args
        if hit and proc.pid not in {p.pid for p in found}:
            found.append(proc)
    assert found, f"no {what} on rank {rank}"
    return found[0]  # a model's first instance: one dead instance of several is a dead model


def children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def remaining(pids: set[int]) -> list[tuple[int, str, str]]:
    """(pid, name, status) of those of `pids` that still exist, zombies included."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found.append((pid, proc.name(), proc.status()))
        except psutil.Error:
            continue
    return found


@dataclass
class Killed:
    killed: float
    what: str
    in_flight: int  # streams not yet ended at the kill
    streams: dict[str, list[Outcome]]
    health: HealthWatch
    gone: float | None  # when no process of the launch was left
    launch_pids: set[int]
    server: Server
    state_dir: Path


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[int, Path]:
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    root = tmp_path_factory.mktemp("deaths")
    return {world: build_tiny_engine(root / f"engine-tp{world}", tp=world) for world in (1, 2)}


LONG_ANSWERS: dict[Path, str] = {}  # engine → its answer to LONG, asked once


def long_answer(server: Server, engine: Path) -> str:
    if engine not in LONG_ANSWERS:
        status, answer = server.generate("ensemble", {"text_input": PROMPT, **LONG})
        assert status == 200 and len(answer["text_output"]) >= LONG_ANSWER, answer
        LONG_ANSWERS[engine] = answer["text_output"]
    return LONG_ANSWERS[engine]


def kill_under_streams(engine: Path, root: Path, world: int, what: str, rank: int) -> Killed:
    server = Server(patch_repo(engine, None, root / "repo"), world, root / "state")
    try:
        server.long_answer = long_answer(server, engine)
        # looked up before the streams start (listing every process is slow on a loaded machine); they stay
        launch_pids = {p.pid for p in repo_processes(root / "repo") for p in [p, *children(p)]} | {server.state["pid"]}
        target = victim(root / "repo", what, rank)
        streams = [Stream(server, path) for path, count in STREAMS.items() for _ in range(count)]
        long_ones, queued = [s for s in streams if s.path != "openai"], [s for s in streams if s.path == "openai"]
        for stream in long_ones:
            stream.start()
        wait_for_the_kill_moment(long_ones, queued, len(server.long_answer) // 2)
        health = HealthWatch(server)
        health.start()
        killed = time.monotonic()
        os.kill(target.pid, signal.SIGKILL)
        in_flight = sum(stream.outcome.how is None for stream in streams)
        chars_at_kill = [answered(stream) for stream in long_ones]
        for stream in streams:
            stream.join(max(0.0, killed + BOUND_S + 5 - time.monotonic()))
        gone = None
        while time.monotonic() < killed + GONE_S:
            if not repo_processes(root / "repo") and not remaining(launch_pids):
                gone = time.monotonic()
                break
            time.sleep(0.1)
        health.done.set()
        health.join()
        outcomes: dict[str, list[Outcome]] = {}
        for stream in streams:
            outcomes.setdefault(stream.path, []).append(stream.outcome)
        print(f"\nws{world} {what} rank {rank} killed at {time.time() - (time.monotonic() - killed):.3f}, "
              f"{in_flight} streams in flight, the long ones at {chars_at_kill} characters:", {path: [(o.how, o.ended and round(o.ended - killed, 2), o.detail[:80])
                                                          for o in found] for path, found in outcomes.items()})
        return Killed(killed, what, in_flight, outcomes, health, gone, launch_pids, server, root / "state")
    finally:
        server.kill_leftovers()


@pytest.fixture(scope="module", params=KILLS, ids=[f"ws{w}-{what}-rank{r}" for w, what, r in KILLS])
def killed(request, engines, tmp_path_factory) -> Killed:
    world, what, rank = request.param
    return kill_under_streams(engines[world], tmp_path_factory.mktemp(f"kill-ws{world}"), world, what, rank)


def test_every_stream_in_flight_ends_within_the_bound(killed):
    late = {path: [(o.how, o.ended and round(o.ended - killed.killed, 2), o.detail, len(o.pieces)) for o in outcomes
                   if o.how is None or o.ended - killed.killed > BOUND_S]
            for path, outcomes in killed.streams.items()}
    assert {path: found for path, found in late.items() if found} == {}
    assert killed.in_flight >= 1
    errors = sum(o.how in ("error", "closed") for outcomes in killed.streams.values() for o in outcomes)
    if killed.what != "stub:preprocessing":  # every other victim is on the path of streams in flight: it strands them
        assert errors >= 1
    assert [o for outcomes in killed.streams.values() for o in outcomes if o.how in ("wrong", "client")] == []


def test_health_is_not_200_within_the_bound_and_stays_so(killed):
    late = {url: round(last - killed.killed, 3) for url in killed.health.urls
            if (last := killed.health.last_200(url)) is not None and last - killed.killed > HEALTH_BOUND_S}
    assert late == {}, f"answered 200 this long after the kill: {late}"


def test_the_launch_stops_whole_and_leaves_nothing(killed):
    assert killed.gone is not None, (remaining(killed.launch_pids), repo_processes(killed.server.repo))
    assert killed.server.cli("status").stdout.strip() == "no launches"
    assert not list(killed.state_dir.glob("*/state.json"))
    assert not list(Path("/dev/shm").glob(f"{killed.server.state['shm_base']}*"))
    log = "".join(p.read_text(errors="replace") for p in killed.state_dir.glob("*/logs/supervisor.log"))
    assert "died; stopped all ranks" in log or "exited with status" in log
