"""A python model's process (its `triton_python_backend_stub`) killed with SIGKILL in the middle of
requests, on a real launched server of the fixture's engine (CPU): what every request in flight gets
and how soon, that the supervisor loads the model again within RESTART_S, and that requests sent
after that are answered.

Each scenario launches its own server, starts long requests (480 tokens) on both client-facing
models, over HTTP generate / generate_stream and gRPC streaming, whole and streamed, kills its
stubs once every stream has its first piece, waits at most BOUND_S for each request, then for the
supervisor's restart, then sends short requests on the paths that went through the dead model:

- tensorrt_llm killed: every tensorrt_llm_bls request in flight ends with an error naming
  tensorrt_llm (BLS checks the engine's process while it waits). Ensemble requests that were
  inside tensorrt_llm may never end: Triton 2.51 keeps no record of them once the stub is gone
  (xfail).
- tensorrt_llm_bls killed: the engine goes on (it never waits on a response the dead BLS will
  not take), so ensemble requests in flight are answered in full.
- postprocessing killed: streamed ensemble requests end with Triton's error; tensorrt_llm_bls
  (which decodes in-process) is not affected. Whole ensemble requests wait behind the streamed
  responses already queued for the dead model (xfail: needs a queue timeout in its config).
- preprocessing killed: requests already past it are answered.

A stub killed inside its half of a response hand-over leaves a shared-memory mutex whose owner
is dead, and Triton 2.51 then aborts the whole tritonserver (`boost::interprocess::lock_exception`;
about one kill in ten here, before trtglm's changes too). Such a scenario is run again on a new
server; any other death of the server fails the test.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import repo_processes
from support.engines import build_tiny_engine
from support.servers import Server

from trtglm.repo import patch_repo

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

BOUND_S = 5.0  # every affected request must have its error within this many seconds of the kill
RESTART_S = 15.0  # the supervisor must have loaded the dead model again within this many seconds of the kill
ATTEMPTS = 3  # servers per scenario, for Triton's abort on a dead stub's mutex
STUB = "triton_python_backend_stub"
LONG = {"max_tokens": 480, "min_length": 480, "bad_words": ["<|user|>", "<|observation|>"]}  # never stops early
LONG_ANSWER = 400  # characters at least in LONG's answer
SHORT = {"max_tokens": 8}
PROMPT = "What is the capital of France?"
MODELS = ("ensemble", "tensorrt_llm_bls")
PATHS = [(model, transport, stream) for model in MODELS for transport in ("http", "grpc") for stream in (False, True)]


@dataclass
class Outcome:
    """What one request got: its pieces of text, and how it ended (an error, or complete)."""

    pieces: list[str] = field(default_factory=list)
    error: str | None = None
    ended: float | None = None  # time.monotonic() of the server's last answer; None while waiting
    client_failure: str | None = None  # the client gave up or broke (not an answer from the server)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Call(threading.Thread):
    """One request on one path, run on a thread of its own; `started` is set at its first piece."""

    def __init__(self, server: Server, model: str, transport: str, stream: bool, body: dict):
        super().__init__(daemon=True, name=f"{model}-{transport}-{'stream' if stream else 'whole'}")
        self.server, self.model, self.transport, self.stream, self.body = server, model, transport, stream, body
        self.path = (model, transport, stream)
        self.outcome = Outcome()
        self.started = threading.Event()

    def run(self) -> None:
        try:
            (self._http if self.transport == "http" else self._grpc)()
        except Exception as e:
            self.outcome.client_failure = f"{type(e).__name__}: {e}"

    def _answer(self, event: dict) -> bool:
        """Take one response; True when it ends the request."""
        if "error" in event:
            self.outcome.error, self.outcome.ended = event["error"], time.monotonic()
            return True
        self.outcome.pieces.append(event.get("text_output", ""))
        self.started.set()
        return False

    def _http(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=BOUND_S + 5)
        path = f"/v2/models/{self.model}/generate" + ("_stream" if self.stream else "")
        connection.request("POST", path, json.dumps({"text_input": PROMPT, "stream": self.stream, **self.body}),
                           {"Content-Type": "application/json"})
        try:
            response = connection.getresponse()
            if not self.stream:
                self._answer(json.loads(response.read()))
            else:
                for line in response:
                    if line.startswith(b"data:") and self._answer(json.loads(line[5:])):
                        break
            self.outcome.ended = self.outcome.ended or time.monotonic()
        finally:
            connection.close()

    def _grpc(self) -> None:
        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(self.model, grpc_inputs(grpc, self.body, self.stream),
                                      enable_empty_final_response=True)
            while True:
                result, error = answers.get(timeout=BOUND_S + 5)
                if error is not None:
                    self._answer({"error": error.message()})
                    return
                text = result.as_numpy("text_output")  # absent from an empty final response
                if text is not None:
                    self._answer({"text_output": "".join(t.decode() for t in text.reshape(-1))})
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.outcome.ended = time.monotonic()
                    return
        except queue.Empty:
            self.outcome.client_failure = "no answer"
        finally:  # stop_stream waits for the requests it cancels: never in this thread
            threading.Thread(target=lambda: (client.stop_stream(cancel_requests=True), client.close()),
                             daemon=True).start()


def grpc_inputs(grpc, body: dict, stream: bool) -> list:
    arrays = {"text_input": np.array([[PROMPT.encode()]], np.object_),
              "max_tokens": np.array([[body["max_tokens"]]], np.int32), "stream": np.array([[stream]], np.bool_)}
    if "min_length" in body:
        arrays["min_length"] = np.array([[body["min_length"]]], np.int32)
        arrays["bad_words"] = np.array([[w.encode() for w in body["bad_words"]]], np.object_)
    types = {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL"}
    tensors = []
    for name, array in arrays.items():
        tensor = grpc.InferInput(name, list(array.shape), types[array.dtype.type])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@dataclass
class Scenario:
    """A stub killed while `in_flight` ran; `after`: requests sent once the supervisor had restarted it."""

    killed: float
    in_flight: dict[tuple, Outcome]
    restarted: float | None  # when the supervisor logged the model running again
    after_sent: float
    after: dict[tuple, Outcome]


def run_scenario(server: Server, model: str, after_paths: list[tuple], state_dir: Path) -> Scenario | None:
    """The scenario's outcomes; None when Triton aborted on the dead stub's mutex (see the module's doc)."""
    tritonserver = next(p for p in repo_processes(server.repo) if p.name() == "tritonserver")
    calls = [Call(server, *path, LONG) for path in PATHS]
    for call in calls:
        call.start()
    for call in calls:
        if call.stream:
            assert call.started.wait(30), f"{call.name}: no first piece"
    killed = kill_stub(server.repo, model)
    wait_for(calls, killed + BOUND_S)
    restarted = wait_for_restart(state_dir, model, killed + RESTART_S)
    after = [Call(server, *path, SHORT) for path in after_paths]
    sent = time.monotonic()
    for call in after:
        call.start()
    wait_for(after, sent + BOUND_S)
    if not psutil_alive(tritonserver):
        assert_aborted_on_mutex(state_dir)
        return None
    return Scenario(killed, {c.path: c.outcome for c in calls}, restarted, sent, {c.path: c.outcome for c in after})


def assert_aborted_on_mutex(state_dir: Path) -> None:
    """The one death of tritonserver these scenarios accept (see the module's doc)."""
    log = "\n".join(path.read_text(errors="replace") for path in state_dir.glob("**/rank.0/stderr"))
    assert "boost::interprocess::lock_exception" in log, f"tritonserver died:\n{log[-3000:]}"


def stop(server: Server, state_dir: Path) -> None:
    """`trtglm stop`, or, where the launch already ended because Triton aborted late, only the clean-up."""
    if any(p.name() == "tritonserver" for p in repo_processes(server.repo)):
        server.stop()
        return
    server.kill_leftovers()
    assert_aborted_on_mutex(state_dir)


def wait_for_restart(state_dir: Path, model: str, deadline: float) -> float | None:
    """When the supervisor's log first said `model` runs again (None if not by `deadline`)."""
    while True:
        logs = "".join(p.read_text(errors="replace") for p in state_dir.glob("**/supervisor.log"))
        if f"{model}: running again" in logs:
            return time.monotonic()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def kill_stub(repo: Path, model: str) -> float:
    """SIGKILL the python-backend stubs of all of `model`'s instances in the server of `repo`; when they were
    killed. All of them: with one left alive, Triton would send it every later response and a stream might
    never meet the dead one."""
    stubs = []
    for proc in repo_processes(repo):
        try:
            args = proc.cmdline()
        except psutil.Error:
            continue
        if os.path.basename(args[0]) == STUB and any(a.startswith(f"{model}_0_") for a in args):
            stubs.append(proc)
    assert stubs, f"no stub of {model}"
    killed = time.monotonic()
    for stub in stubs:
        os.kill(stub.pid, signal.SIGKILL)
    return killed


def psutil_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(calls: list[Call], deadline: float) -> None:
    for call in calls:
        call.join(max(0.0, deadline - time.monotonic()))


def errors_in_time(outcomes: dict[tuple, Outcome], since: float, *words: str) -> list[str]:
    """Why each outcome is not an error naming `words` within BOUND_S of `since` (empty when all are)."""
    wrong = []
    for key, outcome in outcomes.items():
        took = None if outcome.ended is None else round(outcome.ended - since, 2)
        if outcome.error is None or took is None or took > BOUND_S or not all(w in outcome.error for w in words):
            wrong.append(f"{key}: after {took} s, error {outcome.error!r}, client {outcome.client_failure!r}, "
                         f"{len(outcome.pieces)} pieces")
    return wrong


def answered_in_full(outcomes: dict[tuple, Outcome], by: float, at_least: int) -> list[str]:
    """Why the outcomes are not one and the same complete answer (whole or streamed) ended by `by`."""
    wrong = [f"{key}: error {o.error!r}, client {o.client_failure!r}, ended {o.ended and round(o.ended - by, 2)} s "
             f"after the bound, {len(o.pieces)} pieces"
             for key, o in outcomes.items() if o.error or o.ended is None or o.ended > by]
    texts = {o.text for o in outcomes.values()}
    if len(texts) != 1 or len(min(texts, key=len)) < at_least:
        wrong.append(f"not one answer of at least {at_least} characters: {[t[:60] for t in texts]}")
    return wrong


def of(outcomes: dict[tuple, Outcome], model: str, stream: bool | None = None) -> dict[tuple, Outcome]:
    return {k: o for k, o in outcomes.items() if k[0] == model and stream in (None, k[2])}


# --- the servers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    return build_tiny_engine(tmp_path_factory.mktemp("dead-submodel") / "engine")


@pytest.fixture(scope="module")
def stopping():
    """Servers are stopped in the background (one with hung requests takes its exit timeout), all by the end."""
    with ThreadPoolExecutor(4) as pool:
        futures = []
        yield lambda server, state_dir: futures.append(pool.submit(stop, server, state_dir))
        for future in futures:
            future.result()


def scenario(engine: Path, tmp_path_factory, stopping, model: str, after_paths: list[tuple]) -> Scenario:
    """A server of its own in which `model`'s stub is killed."""
    for _ in range(ATTEMPTS):
        root = tmp_path_factory.mktemp(f"kill-{model}")
        server = Server(patch_repo(engine, None, root / "repo"), 1, root / "state")
        try:
            result = run_scenario(server, model, after_paths, root / "state")
        finally:
            stopping(server, root / "state")
        if result is not None:
            return result
    pytest.fail(f"tritonserver aborted on the dead stub's mutex {ATTEMPTS} times in a row")


@pytest.fixture(scope="module")
def engine_killed(engine, tmp_path_factory, stopping) -> Scenario:
    return scenario(engine, tmp_path_factory, stopping, "tensorrt_llm", PATHS)


@pytest.fixture(scope="module")
def bls_killed(engine, tmp_path_factory, stopping) -> Scenario:
    after = [p for p in PATHS if p[0] == "ensemble"] + [("tensorrt_llm_bls", "http", True)]
    return scenario(engine, tmp_path_factory, stopping, "tensorrt_llm_bls", after)


@pytest.fixture(scope="module")
def postprocessing_killed(engine, tmp_path_factory, stopping) -> Scenario:
    return scenario(engine, tmp_path_factory, stopping, "postprocessing", [p for p in PATHS if p[0] == "ensemble"])


@pytest.fixture(scope="module")
def preprocessing_killed(engine, tmp_path_factory, stopping) -> Scenario:
    return scenario(engine, tmp_path_factory, stopping, "preprocessing", PATHS)


# --- tensorrt_llm -----------------------------------------------------------------------------------------


def test_a_dead_engine_ends_every_bls_request_with_an_error_naming_it(engine_killed):
    s = engine_killed
    assert errors_in_time(of(s.in_flight, "tensorrt_llm_bls"), s.killed, "tensorrt_llm", "exited") == []


def test_a_dead_engine_is_loaded_again_and_every_path_answers(engine_killed):
    s = engine_killed
    assert s.restarted is not None and s.restarted - s.killed <= RESTART_S
    assert answered_in_full(s.after, s.after_sent + BOUND_S, len("The capital")) == []


@pytest.mark.xfail(reason="Triton 2.51 never ends requests that were inside a python stub that died (the ensemble "
                          "waits on them until the model is unloaded, if then); no python model can answer them")
def test_a_dead_engine_ends_ensemble_requests_in_flight(engine_killed):
    assert errors_in_time(of(engine_killed.in_flight, "ensemble"), engine_killed.killed, "tensorrt_llm") == []


# --- tensorrt_llm_bls ---------------------------------------------------------------------------------------


def test_a_dead_bls_does_not_stall_the_engine_for_the_ensemble(bls_killed):
    s = bls_killed
    assert answered_in_full(of(s.in_flight, "ensemble"), s.killed + BOUND_S, LONG_ANSWER) == []
    assert s.restarted is not None and s.restarted - s.killed <= RESTART_S
    assert answered_in_full(s.after, s.after_sent + BOUND_S, len("The capital")) == []


# --- postprocessing -----------------------------------------------------------------------------------------


def test_a_dead_postprocessing_ends_streamed_ensemble_requests(postprocessing_killed):
    s = postprocessing_killed
    assert answered_in_full(s.after, s.after_sent + BOUND_S, len("The capital")) == []
    assert errors_in_time(of(s.in_flight, "ensemble", True), s.killed,
                          "Stub process 'postprocessing_0_", "is not healthy") == []
    assert answered_in_full(of(s.in_flight, "tensorrt_llm_bls"), s.killed + BOUND_S, LONG_ANSWER) == []


@pytest.mark.xfail(reason="a whole reply reaches postprocessing behind the streamed responses already queued for it, "
                          "each batch failing after 1-2 s; a queue timeout in postprocessing's config would bound it")
def test_a_dead_postprocessing_ends_whole_ensemble_requests(postprocessing_killed):
    s = postprocessing_killed
    assert errors_in_time(of(s.in_flight, "ensemble", False), s.killed, "postprocessing") == []


# --- preprocessing ------------------------------------------------------------------------------------------


def test_a_dead_preprocessing_is_loaded_again_and_requests_past_it_are_answered(preprocessing_killed):
    s = preprocessing_killed
    assert answered_in_full(s.in_flight, s.killed + BOUND_S, LONG_ANSWER) == []  # all were past preprocessing
    assert s.restarted is not None and s.restarted - s.killed <= RESTART_S
    assert answered_in_full(s.after, s.after_sent + BOUND_S, len("The capital")) == []
