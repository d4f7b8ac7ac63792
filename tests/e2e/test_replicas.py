"""`trtglm launch --replicas N` on the CPU: real tritonservers (mpirun for two ranks), their engines and OpenAI
APIs, behind a real Envoy. Through the front, over Triton's HTTP (whole and server-sent events), Triton's gRPC
(NVIDIA's own client, streamed) and the OpenAI API (the openai SDK), every answer is the fixture's exact one
and both replicas serve (their own token counters). A replica's tritonserver killed under load: only streams on
it fail, each with an error, the other replica serves meanwhile, and the killed one comes back and serves
again. `stop` leaves no process, shared memory or state behind; bad flags are one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import SHARED, free_ports, repo_processes
from support.servers import Launched, fixture_answers
from trtglm.client import GenerateRequest, ServerError
from trtglm.client import grpc as grpc_client
from trtglm.client import http as http_client

pytestmark = pytest.mark.slow
NVIDIA_CLIENT = SHARED / "upstream/tensorrtllm_backend-v0.19.0/clients/inflight_batcher_llm/client/end_to_end_grpc_client.py"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
QUESTIONS = list(fixture_answers())[:6]


def free_block(size: int, avoid: set[int] = frozenset()) -> int:
    """The first port of `size` consecutive ports free a moment ago, none of them in `avoid`."""
    for base in free_ports(20):
        ports = range(base, base + size)
        if all(_free(port) and port not in avoid for port in ports):
            return base
    raise RuntimeError(f"no {size} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Fleet(Launched):
    """A detached launch of `replicas` replicas of the fixture's engine behind the front."""

    def __init__(self, root: Path, replicas: int, build_flags: tuple[str, ...] = (), world_size: int = 1):
        super().__init__(root, build_flags=build_flags)
        self.block = free_block(4 * replicas, avoid=set(self.ports.values()))
        self.launch_flags = ("--replicas", str(replicas), "--replica-ports", str(self.block),
                             "--world-size", str(world_size))

    def status(self) -> dict:
        done = self.run("status", "--json")
        assert done.returncode == 0, done.stderr
        return next(row for row in json.loads(done.stdout) if row["repo"] == str(self.repo.resolve()))

    def replica_tokens(self) -> list[float]:
        """Each replica's trtglm_generated_tokens_total, from its own metrics port."""
        counts = []
        for replica in self.status()["replicas"]:
            with NO_PROXY.open(f"http://127.0.0.1:{replica['ports']['metrics']}/metrics", timeout=10) as reply:
                lines = reply.read().decode().splitlines()
            counts.append(sum(float(line.split()[-1]) for line in lines
                              if line.startswith("trtglm_generated_tokens_total")))
        return counts

    def state(self) -> dict:
        return json.loads(next((self.root / "state").glob("*/state.json")).read_text())

    def running(self) -> bool:
        return any((self.root / "state").glob("*/state.json"))

    def stop_and_check_nothing_left(self) -> None:
        state = self.state()
        pids = [pid for pid in (state["pid"], state["front_pid"], *(r["pid"] for r in state["replicas"])) if pid]
        bases = [r["shm_base"] for r in state["replicas"]]
        stopped = self.run("stop", "--repo", str(self.repo), timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        left += [p.pid for p in repo_processes(self.repo)]
        assert left == [], f"left running after stop: {left}"
        assert not [path for base in bases for path in Path("/dev/shm").glob(f"{base}*")]
        assert not list((self.root / "state").glob("*/state.json"))


def ask_everything(fleet: Fleet) -> None:
    """Every question over each protocol through the front, several at once: each answer exact."""
    answers = fixture_answers()
    asks = []
    for question in QUESTIONS:
        request = GenerateRequest(question, 64, stream=False)
        asks += [lambda q=question, r=request: http_client.generate(fleet.url, "ensemble", r),
                 lambda q=question: "".join(http_client.generate_stream(
                     fleet.url, "tensorrt_llm_bls", GenerateRequest(q, 64, stream=True))),
                 lambda q=question: "".join(grpc_client.generate_stream(
                     fleet.grpc, "ensemble", GenerateRequest(q, 64, stream=True)))]
    results: dict[int, str] = {}

    def run(index: int) -> None:
        results[index] = asks[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    expected = [answers[q] for q in QUESTIONS for _ in range(3)]
    assert [results.get(i) for i in range(len(asks))] == expected


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("replicas"), 2)
    fleet.start()
    try:
        yield fleet
    finally:
        if fleet.running():
            fleet.stop_and_check_nothing_left()


def test_two_replicas_answer_exactly_over_every_protocol_and_both_serve(fleet):
    before = fleet.replica_tokens()
    ask_everything(fleet)
    after = fleet.replica_tokens()
    assert all(a > b for a, b in zip(after, before)), (before, after)  # least-request spread the load

    from openai import OpenAI

    client = OpenAI(base_url=fleet.openai, api_key="unused")
    reply = client.chat.completions.create(model="tiny", temperature=0,
                                           messages=[{"role": "user", "content": QUESTIONS[0]}])
    assert reply.choices[0].message.content == fixture_answers()[QUESTIONS[0]]
    if NVIDIA_CLIENT.is_file():
        run = subprocess.run([sys.executable, str(NVIDIA_CLIENT), "-u", fleet.grpc, "--model-name", "ensemble",
                              "-p", QUESTIONS[1], "-o", "64", "--streaming", "--check-outputs",
                              "--expected-outputs", json.dumps([fixture_answers()[QUESTIONS[1]]])],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "Received an error" not in run.stdout, run.stdout + run.stderr


def test_status_and_logs_show_each_replica(fleet):
    row = fleet.status()
    assert row["state"] == "ready" and row["ready"] and row["front"]
    assert [(r["index"], r["state"], r["restarts"]) for r in row["replicas"]] == [(0, "ready", 0), (1, "ready", 0)]
    assert row["replicas"][1]["ports"] == {"http": fleet.block + 4, "grpc": fleet.block + 5,
                                           "metrics": fleet.block + 6, "openai": fleet.block + 7}
    text = fleet.run("status")
    assert "  replica 1\tgpus -\tready\t" in text.stdout, text.stdout
    logs = fleet.run("logs", "--repo", str(fleet.repo), "--replica", "1", "--lines", "5")
    assert logs.returncode == 0 and "replica-1" in logs.stdout and "front.log" in logs.stdout, logs.stdout
    for flags, words in ((("--replica", "2"), "pass --replica 0 to 1"), ((), "pass --replica 0 to 1"),
                         (("--replica", "0", "--rank", "3"), "--rank 3: the launch has 1 rank(s)")):
        bad = fleet.run("logs", "--repo", str(fleet.repo), *flags)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    with NO_PROXY.open(f"http://127.0.0.1:{fleet.ports['metrics']}/metrics", timeout=10) as reply:
        front_metrics = reply.read().decode()
    assert "envoy_cluster_upstream_rq_total" in front_metrics  # the front's own statistics


LONG = 480  # tokens: the fixture engine's max_seq_len (512) less the prompt


class LongRequest(GenerateRequest):
    """A request that runs to its max_tokens (min_length: the ensemble's input for TensorRT-LLM's min tokens)."""

    def inputs(self) -> dict:
        return {**super().inputs(), "min_length": self.max_tokens}


LONG_REQUEST = LongRequest(QUESTIONS[0], LONG, stream=True)


def stream_long(fleet: Fleet, outcomes: list, started: list, index: int) -> None:
    """One long streamed answer through the front (as many tokens as the engine holds): ("done", text) or
    ("error", message); `started[index]` is set at its first event. trtglm's client tells a stream cut short
    (a chunked body without its last chunk) from a finished one, as curl does (exit 18)."""
    text = ""
    try:
        for piece in http_client.generate_stream(fleet.url, "ensemble", LONG_REQUEST, timeout=120):
            text += piece
            started[index].set()
        outcomes[index] = ("done", text)
    except ServerError as e:
        outcomes[index] = ("error", str(e))
    finally:
        started[index].set()




def test_a_killed_replica_comes_back_while_the_other_serves(fleet):
    victim = json.loads((Path(fleet.state()["replicas"][0]["launch_dir"]) / "state.json").read_text())["server_pid"]
    outcomes: list = [None] * 8
    started = [threading.Event() for _ in outcomes]
    threads = [threading.Thread(target=stream_long, args=(fleet, outcomes, started, i)) for i in range(len(outcomes))]
    for thread in threads:
        thread.start()
    for event in started:  # every stream under way (least-request: half on each replica)
        event.wait(60)
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert all(outcome is not None for outcome in outcomes), outcomes  # none hangs
    finished = [o for o in outcomes if o[0] == "done"]
    failed = [o for o in outcomes if o[0] == "error"]
    assert finished and failed, outcomes  # the streams on the killed replica failed, the others' finished
    assert all(text == finished[0][1] and len(text) > 400 for _, text in finished)  # each finished one whole
    assert all("broke off" in message for _, message in failed), failed

    ask_everything(fleet)  # served meanwhile, with replica 0 down or starting
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        replica = fleet.status()["replicas"][0]
        if replica["state"] == "ready":
            break
        time.sleep(1)
    assert (replica["state"], replica["restarts"]) == ("ready", 1), replica
    before = fleet.replica_tokens()
    ask_everything(fleet)
    assert fleet.replica_tokens()[0] > before[0]  # the restarted replica serves again


def test_two_replicas_of_two_ranks_answer_exactly(tmp_path):
    fleet = Fleet(tmp_path, 2, build_flags=("--set", "convert.tp_size=2"), world_size=2)
    fleet.start()
    try:
        before = fleet.replica_tokens()
        ask_everything(fleet)
        assert all(a > b for a, b in zip(fleet.replica_tokens(), before))
    finally:
        fleet.stop_and_check_nothing_left()


@pytest.mark.parametrize("flags, env, words", [
    (("--replicas", "0"), {}, "--replicas must be a positive whole number"),
    (("--replicas", "2", "--no-front"), {}, "--replicas above 1 serves through the front"),
    (("--replicas", "2"), {"CUDA_VISIBLE_DEVICES": "0"}, "2 replica(s) × world size 1 need 2 GPUs, but 1 are visible"),
    (("--replicas", "2", "--gpus", "0,0"), {"CUDA_VISIBLE_DEVICES": "0,1"}, "--gpus must name 2 different GPUs"),
])
def test_bad_flags_are_one_line(fleet, flags, env, words):
    done = subprocess.run([sys.executable, "-m", "trtglm", "launch", "--repo", str(fleet.repo), *flags],
                          capture_output=True, text=True, timeout=60, env={**fleet.env, **env})
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_busy_front_or_replica_port_is_one_line(tmp_path, fleet):
    """A copy of the served repository (the same one is refused as already served) on the front's ports or on the
    replicas' ports of the running launch: one line each."""
    copy = tmp_path / "repo"
    subprocess.run(["cp", "-r", str(fleet.repo), str(copy)], check=True)
    for busy, flags in ((fleet.ports["http"], ()), (fleet.block, ("--replica-ports", str(fleet.block)))):
        done = subprocess.run([sys.executable, "-m", "trtglm", "launch", "--repo", str(copy), "--replicas", "2",
                               "--http-port", str(fleet.ports["http"] if not flags else free_ports(1)[0]), *flags],
                              capture_output=True, text=True, timeout=60, env=fleet.env)
        assert done.returncode == 2 and f"{busy} on 127.0.0.1 is in use" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


TRITON_POSTS = ["/v2/models/ensemble/infer", "/v2/models/ensemble/versions/1/infer", "/v2/models/ensemble/generate",
                "/v2/models/tensorrt_llm_bls/generate_stream", "/v2/repository/index",
                "/v2/repository/models/ensemble/load", "/v2/repository/models/ensemble/unload",
                "/v2/systemsharedmemory/region/r/register", "/v2/cudasharedmemory/region/r/register",
                "/v2/trace/setting", "/v2/models/ensemble/trace/setting", "/v2/logging"]


@pytest.mark.reliability
def test_deeply_nested_json_on_every_triton_http_endpoint_is_refused_and_the_launch_serves_on(fleet):
    """120k levels (240 KB) kill Triton 2.51's HTTP frontend, 1M under another key (2 MB) its ensemble's; through the
    front each is a 400 on every endpoint that reads a body, and nothing restarts."""
    deep = b'{"inputs":' + b"[" * 120_000 + b"]" * 120_000 + b"}"
    keyed = b'{"id":"[\\"[","parameters":{"x":' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}}"
    restarts = [r["restarts"] for r in fleet.status()["replicas"]]
    for path in TRITON_POSTS:
        for body in (deep, keyed):
            request = urllib.request.Request(f"{fleet.url}{path}", data=body, method="POST")
            try:
                NO_PROXY.open(request, timeout=60).close()
                status = 200
            except urllib.error.HTTPError as e:
                status, answer = e.code, e.read().decode()
            assert status == 400 and "nests deeper than 64 levels" in answer, (path, status)
    ask_everything(fleet)
    replicas = fleet.status()["replicas"]
    assert [r["restarts"] for r in replicas] == restarts and all(r["state"] == "ready" for r in replicas)


def test_triton_binary_tensors_pass_the_guard(fleet, fixture_dir):
    """tritonclient's HTTP infer with binary tensors (a JSON header, then raw bytes: here a stop word of 200 '['):
    the guard reads only the header, and preprocessing's prompt ids are the chat format's."""
    import numpy as np
    import tritonclient.http as triton_http

    from trtglm.chatglm.chat import chat_ids
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer

    question = QUESTIONS[2]
    values = {"QUERY": np.array([[question.encode()]], dtype=object),
              "REQUEST_OUTPUT_LEN": np.array([[64]], np.int32), "STOP_WORDS_DICT": np.array([[b"[" * 200]], dtype=object)}
    inputs = []
    for name, value in values.items():
        inputs.append(triton_http.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "INT32"))
        inputs[-1].set_data_from_numpy(value, binary_data=True)
    client = triton_http.InferenceServerClient(fleet.url.removeprefix("http://"))
    result = client.infer("preprocessing", inputs, outputs=[triton_http.InferRequestedOutput("INPUT_ID")])
    expected = chat_ids(ChatGLMTokenizer(fixture_dir), [{"role": "user", "content": question}])
    assert result.as_numpy("INPUT_ID").ravel().tolist() == list(expected)
