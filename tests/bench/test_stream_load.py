"""The served benchmark's load generator (trtglm.bench: workload, stream_load, load_stats) and its pipeline.

Prompts are built to exact lengths from the tokenizer; the closed loop never has more than
`concurrency` requests in flight; against a launched fixture server (support.servers), the
tokens the client counts from the ensemble's streamed responses, over HTTP server-sent events
and gRPC, are the tokens the server's own counter says it generated, every request finishing
within its max_tokens; tensorrt_llm_bls's events never count more than the server generated;
the in-process run through the server's engine counts what its executor returned. Last, the
whole pipeline (build, repository, two timed launches, the measurements) on the tiny fixture."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import pytest
from conftest import FIXTURE, REPO
from support.servers import launched_server

from trtglm.bench import load_stats, stream_load
from trtglm.bench.workload import fixed_workload, mixed_workload, piece_pool, prompt_text
from trtglm.chatglm.chat import prompt_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer


@pytest.fixture(scope="module")
def tok() -> ChatGLMTokenizer:
    return ChatGLMTokenizer(FIXTURE)


def test_prompts_have_the_asked_number_of_ids(tok):
    rng, pool = random.Random(0), piece_pool(tok)
    for target in (8, 9, 32, 128, 250):
        text = prompt_text(tok, target, rng, pool)
        assert len(prompt_ids(tok, text)) == target, (target, text)
        assert text[0].isalnum()  # never read as a JSON chat
    workload = mixed_workload(tok, 20, 4, (16, 200), (4, 8), seed=3)
    lengths = [len(ids) for ids in workload.prompt_ids]
    assert all(16 <= n <= 200 for n in lengths) and len(set(lengths)) > 10
    assert workload.prompt_ids == tuple(tuple(prompt_ids(tok, text)) for text in workload.texts)
    assert all(4 <= n <= 8 for n in workload.max_tokens)
    assert workload.describe()["prompt_tokens"]["total"] == sum(lengths)


def test_tokens_per_response_come_from_the_log_probs():
    import numpy as np

    assert stream_load.tokens_in(0.0, "") == 1  # HTTP: one value is a number
    assert stream_load.tokens_in([0.0, 0.0], "x") == 2
    assert stream_load.tokens_in([], "") == 0  # a final response without tokens
    assert stream_load.tokens_in(np.zeros((1, 1, 3), np.float32), None) == 3  # gRPC
    assert stream_load.tokens_in(None, "text") == 1 and stream_load.tokens_in(None, "") == 0


def test_the_closed_loop_keeps_concurrency_requests_in_flight(tok):
    workload = fixed_workload(tok, 12, 3, 16, 2, seed=0)
    lock, in_flight, most = threading.Lock(), [0], [0]

    def send(index: int, trace: stream_load.Trace) -> None:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            trace.submitted = time.perf_counter()
            time.sleep(0.01)
            if index == 5:
                raise RuntimeError("refused")
            trace.add(time.perf_counter(), 2)
        finally:
            with lock:
                in_flight[0] -= 1

    traces, elapsed = stream_load.closed_loop(workload, send, "test")
    assert most[0] == 3 and elapsed > 0
    result = load_stats.stats(workload, traces, elapsed)
    assert (result["failed"], result["errors"], result["generated_tokens"]) == (1, ["refused"], 22)


# --- against a launched fixture server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    yield from launched_server(tmp_path_factory.mktemp("stream-load"))


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_streamed_tokens_are_the_tokens_the_server_generated(served, tok, protocol):
    workload = fixed_workload(tok, 10, 4, 40, 12, seed=1)
    before = load_stats.settled_tokens(served.metrics)
    for model in ("ensemble", "tensorrt_llm_bls"):
        if protocol == "http":
            traces, elapsed = stream_load.run_http(served.url, model, workload)
        else:
            traces, elapsed = stream_load.run_grpc(served.grpc, model, workload)
        after = load_stats.settled_tokens(served.metrics)
        result = load_stats.stats(workload, traces, elapsed, after - before)
        assert (result["failed"], result["requests"]) == (0, 10), result["errors"]
        assert 0 < result["server_tokens"] <= 10 * 12
        assert all(len(t.times) <= 12 and t.times == sorted(t.times) and t.times[0] > t.submitted for t in traces)
        if model == "ensemble":  # every token counted (several in a response when the server merged them)
            assert result["client_tokens"] == result["server_tokens"] >= result["events"]
            assert result["short_requests"] == sum(len(t.times) < 12 for t in traces)
        else:  # events only where the text grows
            assert result["client_tokens"] <= result["server_tokens"]
        assert result["ttft_ms"]["p50"] > 0 and result["itl_ms"]["p50"] >= 0
        before = after


@pytest.mark.slow
def test_the_in_process_run_counts_what_the_executor_returns(served, tok):
    from trtglm.bench.serving import InProcess, engine_dir_of
    from trtglm.client.http import Server

    runtime = InProcess(engine_dir_of(Server.parse(served.url)), "cpu")
    try:
        workload = fixed_workload(tok, 6, 2, 40, 12, seed=1)
        before = runtime.engine.executor.stats().generated_tokens  # the engine's warm-up requests
        traces, elapsed = stream_load.run_in_process(runtime.engine.executor, workload, tok.eos_id,
                                                     runtime.stop_words)
        result = load_stats.stats(workload, traces, elapsed)
        generated = runtime.engine.executor.stats().generated_tokens - before
        assert result["failed"] == 0 and result["generated_tokens"] == generated
        assert all(0 < len(t.times) <= 12 for t in traces)
    finally:
        runtime.close()


@pytest.mark.slow
def test_the_pipeline_builds_launches_twice_and_measures(tmp_path):
    flags = ["--repeats", "5", "--overhead-tokens", "8", "--requests", "6", "--concurrency", "2", "--prompt-len",
             "40", "--new-tokens", "8", "--paths", "ensemble:http,tensorrt_llm_bls:grpc", "--mixed-requests", "4",
             "--mixed-concurrency", "2", "--mixed-prompts", "16,64", "--mixed-outputs", "4,8",
             "--mixed-paths", "ensemble:grpc"]
    done = subprocess.run([sys.executable, "-m", "trtglm.bench.pipeline", "--out", str(tmp_path / "out"),
                           "--config", "configs/tiny.yaml", "--model-dir", str(FIXTURE), "--work-dir",
                           str(tmp_path / "work"), "--", *flags], capture_output=True, text=True, cwd=REPO,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["served.json", "served.md", "server-cold.log",
                                                    "server-warm.log"]
    results = json.loads((out / "served.json").read_text())
    assert [launch["label"] for launch in results["launches"]] == ["cold", "warm"]
    for launch in results["launches"]:
        assert launch["returncode"] == 0 and 0 < launch["ready_s"] <= launch["launch_s"]
        assert sum(launch["phases"].values()) == pytest.approx(launch["launch_s"], abs=0.05)
        assert any(line.startswith("rank 0: warm-up request in") for line in launch["logged"])
    assert results["overhead"]["served_tokens_per_call"] == results["overhead"]["in_process_tokens_per_call"]
    assert [row["path"] for row in results["fixed"]["runs"]] == ["in-process", "ensemble http",
                                                                 "tensorrt_llm_bls grpc"]
    assert [row["path"] for row in results["mixed"]["runs"]] == ["in-process", "ensemble grpc"]
    for row in results["fixed"]["runs"] + results["mixed"]["runs"]:
        assert row["failed"] == 0 and row["generated_tokens"] > 0, row
    assert "errors" not in results
    assert done.stdout.endswith((out / "served.md").read_text())


@pytest.mark.slow
def test_the_first_tokens_path_adds_up_to_its_ttft(served, tmp_path):
    """`bench latency` through the ensemble: every answered request carries NVIDIA's perf metrics, its path runs
    forward in time (send, tensorrt_llm's arrival, the slot, the first token out, the client's event) on the
    clock the client and the server's processes share."""
    from trtglm.bench.latency import SEGMENTS, bench_latency

    results = bench_latency(url=served.url, metrics_url=served.metrics, model="ensemble", concurrency="3",
                            cases="greedy,top-p", requests_per_slot=2, prompt_len=40, new_tokens=8, seed=0,
                            timeout=120, out=str(tmp_path))
    assert set(results["runs"]) == {"3 greedy", "3 top-p"}
    for run in results["runs"].values():
        assert run["failed"] == 0, run["errors"]
        assert run["first_token"]["traced"] == 6
        parts = run["first_token"]["parts"]
        assert all(parts[name]["p50"] >= 0 and parts[name]["p99"] >= 0 for name, _, _ in SEGMENTS), parts
        assert run["ttft_p50_ms"] > 0 and run["tokens_per_event"] >= 1 and run["itl_p50_ms"] > 0
    saved = json.loads((tmp_path / "latency.json").read_text())
    assert saved["runs"]["3 greedy"]["first_token"] == results["runs"]["3 greedy"]["first_token"]
