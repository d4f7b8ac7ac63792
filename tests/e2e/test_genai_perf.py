"""NVIDIA's genai-perf 0.0.16, with the perf_analyzer of tritonclient 2.51.0 (scripts/setup.sh installs both into
.venv/genai-perf), run unchanged against a `trtglm launch` of the fixture's engine, in trtglm's layout and in
NVIDIA's v0.19.0 one as patch-repo patches it: over gRPC (`--endpoint-type kserve --backend tensorrtllm`) and over
HTTP (generate, generate_stream), on `ensemble` and `tensorrt_llm_bls`, streamed and not. Its prompts are the
fixture's questions (--input-file), so every reply that perf_analyzer records must be the fixture's exact answer,
and genai-perf's output token counts those answers' under the fixture's tokenizer. One more run is the benchmark
of docs/benchmarks.md: synthetic prompts, capped replies."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.repos import upstream_copy
from support.servers import Server, fixture_answers
from trtglm.chatglm.fast_tokenizer import write_fast_tokenizer

pytestmark = pytest.mark.slow
GENAI_PERF = Path(sys.prefix) / "genai-perf"  # the venv scripts/setup.sh puts it in
REQUESTS = 8
# How genai-perf reaches each way in; {model} is the served model's name.
WAYS = {
    "grpc": ("grpc", ["--endpoint-type", "kserve", "--backend", "tensorrtllm"]),
    "grpc-streamed": ("grpc", ["--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming"]),
    "http-generate": ("http", ["--endpoint-type", "generate"]),
    "http-generate_stream": ("http", ["--endpoint-type", "generate", "--endpoint", "v2/models/{model}/generate_stream",
                                      "--streaming"]),
}


@pytest.fixture(scope="module")
def genai_perf_env() -> dict[str, str]:
    """The environment genai-perf runs in: its venv's bin (genai-perf, perf_analyzer) first on PATH, the CUDA runtime
    library perf_analyzer loads on LD_LIBRARY_PATH, loopback never through a proxy. Where a piece is missing the tests
    are skipped, saying which (under CI they fail instead: there setup.sh installs every piece)."""
    cudart = [str(p) for p in GENAI_PERF.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib")]
    env = {**os.environ, "PATH": os.pathsep.join([str(GENAI_PERF / "bin"), os.environ["PATH"]]),
           "LD_LIBRARY_PATH": os.pathsep.join([*cudart, os.environ.get("LD_LIBRARY_PATH", "")]),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    missing = None
    if not (GENAI_PERF / "bin" / "genai-perf").is_file():
        missing = f"genai-perf is not installed in {GENAI_PERF} (run scripts/setup.sh)"
    else:
        started = subprocess.run(["perf_analyzer", "--version"], env=env, capture_output=True, text=True, timeout=60)
        if started.returncode != 0:
            missing = (f"perf_analyzer does not start (libb64.so.0d: apt-get install libb64-0d; libcudart.so.12: "
                       f"scripts/setup.sh): {started.stdout}{started.stderr}".strip())
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)
    return env


# perf_analyzer 2.51 now and then leaves its profile export empty after a streamed gRPC run in which every request
# succeeded (about 1 run in 50 of 8 requests; the server sent no non-finite value, checked at the source); genai-perf
# then fails reading it. Such a run is made once more; any other failure fails the test at once.
EMPTY_EXPORT = "Input is a zero-length, empty document"

LAYOUTS = {"trtglm": lambda root: None, "nvidia-v0.19.0": lambda root: upstream_copy(root, "v0.19.0")}  # -> template


@pytest.fixture(scope="module", params=LAYOUTS)
def server(request, tmp_path_factory):
    """The fixture's engine launched in a repository of each layout."""
    root = tmp_path_factory.mktemp("genai-perf")
    repo = patch_repo(build_tiny_engine(root / "engine"), None, root / "repo", template=LAYOUTS[request.param](root))
    server = Server(repo, 1, root / "state")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(fixture_dir, tmp_path_factory) -> Path:
    """The fixture's tokenizer as genai-perf's AutoTokenizer loads it (without remote code)."""
    return write_fast_tokenizer(fixture_dir, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    """The fixture's one-message questions as genai-perf's --input-file."""
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    path.write_text("".join(json.dumps({"text": question}) + "\n" for question in fixture_answers()))
    return path


def run_genai_perf(env: dict, server, model: str, way: str, tokenizer: Path, artifacts: Path,
                   *prompts: str) -> tuple[dict, list[dict]]:
    """`genai-perf profile` of `model` the `way` given (WAYS) with `prompts` flags: its metrics
    (profile_export_genai_perf.json) and perf_analyzer's record of each request (profile_export.json)."""
    protocol, flags = WAYS[way]
    command = ["genai-perf", "profile", "-m", model, *(f.format(model=model) for f in flags),
               "-u", f"127.0.0.1:{getattr(server, f'{protocol}_port')}", "--tokenizer", str(tokenizer),
               "--request-count", str(REQUESTS), "--concurrency", "2", "--artifact-dir", str(artifacts), *prompts]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and EMPTY_EXPORT in run.stdout + run.stderr:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    metrics = json.loads(next(artifacts.rglob("profile_export_genai_perf.json")).read_text())
    record = json.loads(next(artifacts.rglob("profile_export.json")).read_text())
    return metrics, record["experiments"][0]["requests"]


def question(request: dict) -> str:
    """The prompt of a recorded request: a text_input tensor (gRPC) or the JSON body's (HTTP)."""
    inputs = request["request_inputs"]
    return inputs["text_input"] if "payload" not in inputs else json.loads(inputs["payload"])["text_input"][0]


def replies(request: dict) -> list[dict]:
    """Each response of a recorded request as the client read it: its tensors (gRPC), or its JSON body, one per
    server-sent event when streamed (HTTP)."""
    found = []
    for output in request["response_outputs"]:
        if "response" not in output:
            found.append(output)
            continue
        for line in output["response"].splitlines():
            body = line.removeprefix("data:").strip()
            found.extend([json.loads(body)] if body else [])
    return found


def reply_text(request: dict) -> str:
    responses = replies(request)
    assert not [r for r in responses if "error" in r], responses
    return "".join(r.get("text_output", "") for r in responses)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("way", WAYS)
def test_genai_perf_gets_the_fixtures_answers(genai_perf_env, server, tokenizer, questions, tmp_path, model, way):
    metrics, requests = run_genai_perf(genai_perf_env, server, model, way, tokenizer, tmp_path,
                                       "--input-file", str(questions), "--output-tokens-mean", "64")
    answers = fixture_answers()
    assert len(requests) == REQUESTS and metrics["request_count"]["avg"] == REQUESTS, metrics
    assert {question(r): reply_text(r) for r in requests} == {question(r): answers[question(r)] for r in requests}
    encode = AutoTokenizer.from_pretrained(tokenizer).encode
    counts = [len(encode(answers[question(r)], add_special_tokens=False)) for r in requests]
    lengths = metrics["output_sequence_length"]
    assert (lengths["min"], lengths["max"]) == (min(counts), max(counts)), lengths
    assert lengths["avg"] == pytest.approx(statistics.mean(counts)), lengths
    if "stream" in way:  # a response per token: genai-perf times the first and those between
        assert all(len(replies(r)) > 2 for r in requests), requests
        assert metrics["time_to_first_token"]["avg"] > 0 and "inter_token_latency" in metrics, metrics


def test_genai_perf_benchmarks_synthetic_prompts(genai_perf_env, server, tokenizer, tmp_path):
    """docs/benchmarks.md's command at a small size: genai-perf's own synthetic prompts of 16 tokens, replies of at
    most 8 (max_tokens), streamed over gRPC."""
    metrics, requests = run_genai_perf(genai_perf_env, server, "ensemble", "grpc-streamed", tokenizer, tmp_path,
                                       "--num-dataset-entries", str(REQUESTS), "--synthetic-input-tokens-mean", "16",
                                       "--output-tokens-mean", "8", "--random-seed", "7")
    assert len(requests) == REQUESTS and metrics["request_count"]["avg"] == REQUESTS, metrics
    assert all(r["request_inputs"]["max_tokens"] == 8 for r in requests), requests
    assert all(reply_text(r) for r in requests), requests
    # one response per generated token and a final empty one
    assert all(2 <= len(replies(r)) <= 8 + 1 for r in requests), [len(replies(r)) for r in requests]
    assert metrics["output_sequence_length"]["min"] >= 1 and metrics["input_sequence_length"]["avg"] >= 15, metrics
