"""NVIDIA's own v0.19.0 client, end_to_end_grpc_client.py, run unchanged against repositories rendered
from trtglm's template and patched from NVIDIA's v0.19.0 (the fixture engine, served by `trtglm launch`
as in test_serving): the reply of `ensemble` and `tensorrt_llm_bls`, streamed and not, with and without
--exclude-input-in-output, checked by the client's own --check-outputs against the fixture's exact answer
(the client adds the prompt itself where NVIDIA's output holds it: not streamed and not excluded)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SHARED
from support.engines import build_tiny_engine
from support.servers import Server
from trtglm.repo import patch_repo

UPSTREAM = SHARED / "upstream/tensorrtllm_backend-v0.19.0"
CLIENT = UPSTREAM / "clients/inflight_batcher_llm/client/end_to_end_grpc_client.py"
TEMPLATES = {"trtglm": None, "nvidia-v0.19.0": UPSTREAM / "inflight_batcher_llm"}  # None: trtglm's own


@pytest.fixture(scope="module", params=TEMPLATES, ids=list(TEMPLATES))
def server(request, tmp_path_factory):
    if not CLIENT.is_file():
        pytest.skip(f"NVIDIA's client is not here: {CLIENT}")
    pytest.importorskip("tritonclient.grpc")
    root = tmp_path_factory.mktemp("nvidia-clients")
    engine = build_tiny_engine(root / "engine", tp=1)
    server = Server(patch_repo(engine, None, root / "repo", TEMPLATES[request.param]), 1, root / "state")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def conversation(fixture_dir) -> dict:
    """A plain-text question (the client's prompt is one user message) whose answer has spaces."""
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    return next(c for c in map(json.loads, lines) if c["messages"][0]["content"] == "What color is the sky?")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("exclude", [False, True], ids=["with-input", "without-input"])
def test_end_to_end_grpc_client_checks_the_fixtures_answer(server, conversation, model, streaming, exclude):
    question = conversation["messages"][0]["content"]
    flags = ["--streaming"] * streaming + ["--exclude-input-in-output"] * exclude
    run = subprocess.run([sys.executable, str(CLIENT), "-u", f"127.0.0.1:{server.grpc_port}", "--model-name",
                          model, "-p", question, "-o", "64", "--check-outputs",
                          "--expected-outputs", json.dumps([conversation["answer"]]), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error" not in run.stdout, run.stdout
    # what the client printed of the reply: the prompt before it exactly when not streamed and not excluded
    shown = question + conversation["answer"] if not (streaming or exclude) else conversation["answer"]
    assert shown in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_gives_the_prompt_before_the_reply_only_when_asked(server, conversation, model):
    """HTTP generate shows one sequence's text_output as a plain string; the prompt comes first only for
    exclude_input_in_output false (left out, it is true)."""
    question, answer = conversation["messages"][0]["content"], conversation["answer"]
    for exclude, expected in ((False, question + answer), (True, answer), (None, answer)):
        body = {"text_input": question, "max_tokens": 64}
        if exclude is not None:
            body["exclude_input_in_output"] = exclude
        status, reply = server.generate(model, body)
        assert (status, reply.get("text_output")) == (200, expected), (exclude, reply)
