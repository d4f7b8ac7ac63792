"""The engine in a process of its own (trtglm.backend.engine_process), as the tensorrt_llm model's stub uses it:
a real child process on the fixture's engine, its answers against generate() on the same checkpoint,
refusals, cancellation, the death of the child, and the rule that a finished request is never asked
whether it was cancelled (Triton frees it once its final response is sent)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection

import pytest
from support.engines import MAX_NEW, build_tiny_engine, chat_prompts, unsplit_answers

from trtglm.backend.engine import engine_info
from trtglm.backend.engine_process import EngineProcess, EngineFacts, MessagePipe
from trtglm.errors import UsageError
from trtglm.request_config import SamplingConfig
from trtglm.runtime.executor import CANCEL_CHECK_S
from trtglm.runtime.request import ExecutorStats, Output, QueueFullError, Request

STOPS = [[518], [520]]  # <|user|>, <|observation|>


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("engine") / "tp1")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return chat_prompts(every=6)


@pytest.fixture(scope="module")
def expected(engine_dir, prompts) -> list[list[int]]:
    return unsplit_answers(engine_dir / "checkpoint", prompts)


@pytest.fixture(scope="module")
def engine(engine_dir):
    deaths: list[str] = []
    process = EngineProcess.start(str(engine_dir), max_queue=4, on_death=deaths.append)
    process.deaths, process.engine_dir = deaths, engine_dir
    yield process
    process.stop()


def collect(engine: EngineProcess, request: Request, is_cancelled=None) -> tuple[list[Output], object]:
    outputs: list[Output] = []
    return outputs, engine.submit(request, outputs.append, is_cancelled)


def test_answers_are_those_of_generate_on_the_same_checkpoint(engine, prompts, expected):
    runs = [collect(engine, Request(p, MAX_NEW, end_id=2, stop_words=STOPS)) for p in prompts]
    for outputs, handle in runs:
        assert handle.done.wait(60)
    assert [[t for o in outputs for t in o.tokens] for outputs, _ in runs] == expected
    assert all(outputs[-1].finished and not outputs[-1].error for outputs, _ in runs)
    info = engine_info(engine.engine_dir)
    assert engine.limits == EngineFacts(0, True, 576, info.max_seq_len, 4 + info.max_batch_size)  # vocabulary padded
    time.sleep(0.3)  # the counters come with the outputs
    stats = engine.stats()
    assert stats.finished >= len(prompts) and stats.generated_tokens >= sum(map(len, expected))


def test_with_kv_cache_reuse_a_shared_prefix_is_computed_once_and_answers_stay_those_of_generate(engine_dir,
                                                                                                  prompts):
    """enable_kv_cache_reuse as the stub passes it: prompts after a common 130-token prefix, one after another;
    blocks of tokens_per_block 64 (configs/tiny.yaml): each later prompt reuses two."""
    prefix = (prompts[0] * 10)[:130]
    shared = [prefix + p for p in prompts[1:4]]
    expected = unsplit_answers(engine_dir / "checkpoint", shared)
    process = EngineProcess.start(str(engine_dir), kv_cache_reuse=True)
    try:
        for prompt, answer in zip(shared, expected):
            outputs, handle = collect(process, Request(prompt, MAX_NEW, end_id=2, stop_words=STOPS))
            assert handle.done.wait(60)
            assert [t for o in outputs for t in o.tokens] == answer
        time.sleep(0.3)  # the counters come with the outputs
        assert process.stats().reused_tokens == 128 * (len(shared) - 1)
    finally:
        process.stop()


def test_enable_kv_cache_reuse_is_off_unless_set_true():
    from trtglm.backend.triton_model import kv_cache_reuse

    values = {"true": True, "1": True, "false": False}
    for text, expected in values.items():
        assert kv_cache_reuse({"enable_kv_cache_reuse": text}, "llm") is expected
    assert kv_cache_reuse({}, "llm") is False
    with pytest.raises(UsageError, match="llm: parameter enable_kv_cache_reuse must be true or false, not 'yes'"):
        kv_cache_reuse({"enable_kv_cache_reuse": "yes"}, "llm")


def test_bad_requests_and_a_full_queue_are_refused_at_once(engine, prompts):
    with pytest.raises(UsageError, match="leaves no room for a token"):
        engine.submit(Request(list(range(1, engine.limits.max_seq_len + 1)), 4), lambda output: None)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        engine.submit(Request([10**6], 4), lambda output: None)
    long = Request(prompts[0], 200, sampling=SamplingConfig(min_tokens=200))  # never stops early
    cancelled = threading.Event()
    runs = [collect(engine, long, cancelled.is_set) for _ in range(engine.limits.capacity)]
    with pytest.raises(QueueFullError, match="busy"):
        engine.submit(long, lambda output: None)
    cancelled.set()
    for outputs, handle in runs:
        assert handle.done.wait(30)
        assert outputs[-1].reason == "cancelled"
    outputs, handle = collect(engine, Request(prompts[0], 4))  # the slots are free again
    assert handle.done.wait(30) and len([t for o in outputs for t in o.tokens]) == 4


def test_a_failing_callback_stops_its_request_in_the_engine(engine, prompts):
    calls = []

    def gone(output: Output) -> None:
        calls.append(output)
        raise ConnectionError("the client is gone")

    handle = engine.submit(Request(prompts[0], 200, sampling=SamplingConfig(min_tokens=200)), gone)
    assert handle.done.wait(10) and len(calls) == 1
    deadline = time.monotonic() + 10
    while engine.stats().active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().active == 0  # the engine freed the slot too


def test_a_finished_request_is_never_asked_whether_it_was_cancelled():
    """The stub's side alone, the engine's side played here: the final output's callback takes long (a slow
    send), and the cancellation watcher must not ask the request meanwhile."""
    ours, theirs = socket.socketpair()
    sleeper = subprocess.Popen(["sleep", "60"])
    engine = EngineProcess(sleeper, MessagePipe(Connection(ours.detach())), EngineFacts(0, True, 100, 64, 4))
    them = MessagePipe(Connection(theirs.detach()))
    asked_after_final, final_sent = [], threading.Event()

    def is_cancelled() -> bool:
        if final_sent.is_set():
            asked_after_final.append(time.monotonic())
        return False

    def on_output(output: Output) -> None:
        if output.finished:
            final_sent.set()
            time.sleep(10 * CANCEL_CHECK_S)  # the watcher runs several times meanwhile

    handle = engine.submit(Request([1, 2], 2), on_output, is_cancelled)
    assert them.receive()[0] == "submit"
    time.sleep(3 * CANCEL_CHECK_S)  # asked while running: fine
    them.send(("outputs", [(handle.id, Output([5], finished=True, reason="length"))], ExecutorStats()))
    assert handle.done.wait(5)
    assert asked_after_final == []
    sleeper.kill()
    engine.stop(timeout=1)


def test_a_bad_engine_folder_fails_the_start_with_one_line(tmp_path):
    with pytest.raises(Exception, match="trtglm.json") as caught:
        EngineProcess.start(str(tmp_path))
    assert "\n" not in str(caught.value)


def test_when_the_engine_process_dies_requests_end_with_an_error_and_the_owner_is_told(engine_dir, prompts):
    deaths: list[str] = []
    process = EngineProcess.start(str(engine_dir), on_death=deaths.append)
    outputs, handle = collect(process, Request(prompts[0], 200, sampling=SamplingConfig(min_tokens=200)))
    while not outputs:
        time.sleep(0.01)
    os.kill(process.process.pid, signal.SIGKILL)
    assert handle.done.wait(5)
    assert outputs[-1].finished and "engine's process ended" in outputs[-1].error
    assert deaths and "exit code -9" in deaths[0]
    with pytest.raises(Exception, match="engine's process ended"):
        process.submit(Request(prompts[0], 4), lambda output: None)
    process.stop(timeout=1)


def test_the_engine_process_ends_when_its_stub_is_gone(engine_dir):
    """A SIGKILLed stub cannot ask: the engine's process sees the end of its socket and exits by itself."""
    process = EngineProcess.start(str(engine_dir))
    child = process.process
    end = socket.socket(fileno=os.dup(process.wire.connection.fileno()))
    end.shutdown(socket.SHUT_RDWR)  # what the kernel does for a dead stub's socket
    end.close()
    assert child.wait(30) == 0
    process.stop(timeout=1)


def test_kv_cache_free_gpu_mem_fraction_is_tensorrt_llms_unless_set():
    from trtglm.backend.triton_model import kv_cache_fraction

    assert kv_cache_fraction({"kv_cache_free_gpu_mem_fraction": "0.5"}, "llm") == 0.5
    assert kv_cache_fraction({}, "llm") == kv_cache_fraction({"kv_cache_free_gpu_mem_fraction": ""}, "llm") == 0.9
    for bad in ("0", "1.5", "half"):
        with pytest.raises(UsageError, match=f"llm: parameter kv_cache_free_gpu_mem_fraction must be a number above 0 "
                                             f"and at most 1, not '{bad}'"):
            kv_cache_fraction({"kv_cache_free_gpu_mem_fraction": bad}, "llm")
