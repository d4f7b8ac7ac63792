"""Rendered repositories loaded by a real Triton server (nvidia-pytriton's tritonserver, CPU, python
backend) with a stand-in engine behind tensorrt_llm: Triton accepts every config, and the ensemble
and the BLS model answer the fixture's conversations exactly, over HTTP generate and
generate_stream (shared/reference/triton-on-cpu.md, trtllm.md §5)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import CONVERSATION_KINDS
from support.cli_calls import patch_repo
from support.repos import STAND_IN_ENGINE, make_engine, template_copy, upstream_copy

from trtglm.chatglm.chat import chat_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer

pytestmark = pytest.mark.slow

LAYOUTS = ("trtglm", "v0.7.1", "v0.19.0")
KINDS = CONVERSATION_KINDS  # the fixture conversations served: the first of each kind


def tritonserver() -> Path:
    try:
        import pytriton
    except ImportError:
        pytest.skip("nvidia-pytriton (which carries tritonserver) is not installed")
    return Path(pytriton.__file__).parent / "tritonserver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One tritonserver on loopback ports, started on a repository and stopped by its pid."""

    def __init__(self, repo: Path, workdir: Path):
        root = tritonserver()
        backend = workdir / "backends" / "python"
        backend.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            (backend / name).symlink_to(root / "backends" / "python" / name)
        stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
        (backend / "triton_python_backend_stub").symlink_to(stub / "triton_python_backend_stub")
        self.port, self.log = free_port(), workdir / "server.log"
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.proc = subprocess.Popen(
            [str(root / "bin" / "tritonserver"), f"--model-repository={repo}",
             f"--backend-directory={workdir / 'backends'}", "--http-address=127.0.0.1", f"--http-port={self.port}",
             "--grpc-address=127.0.0.1", f"--grpc-port={free_port()}", "--metrics-address=127.0.0.1",
             f"--metrics-port={free_port()}", "--allow-gpu-metrics=false", "--exit-timeout-secs=5",
             "--disable-auto-complete-config"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"tritonserver exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"tritonserver not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def generate(self, model: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v2/models/{model}/generate",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, model: str, body: dict) -> tuple[int, list[dict]]:
        """(HTTP status, server-sent events); an error may come as an event or as the status."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v2/models/{model}/generate_stream",
                                         data=json.dumps({**body, "stream": True}).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def as_python_backend(repo: Path) -> None:
    """A repository rendered for a TensorRT engine, its tensorrt_llm served by the stand-in instead."""
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "tensorrtllm"', 'backend: "python"'))
    (repo / "tensorrt_llm" / "1" / "model.py").write_text(STAND_IN_ENGINE)


# request text -> (what the engine generates, the stop token it ends with, the reply a client gets)
SCRIPTED = {
    "[1, 2]": ("\n Paris. \n", "<|user|>", "Paris."),  # JSON that is not a chat is a user message
    "Weather in Beijing?": ("get_weather\n```python\ntool_call(city='Beijing')\n``` \n", "<|observation|>",
                            "get_weather\n```python\ntool_call(city='Beijing')\n```"),
}


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module")
def conversations(fixture_dir) -> list[dict]:
    every = [json.loads(line) for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]
    return [next(c for c in every if matches(c)) for matches in KINDS.values()]


@pytest.fixture(scope="module", params=LAYOUTS)
def server(request, tmp_path_factory, fixture_dir, tok, conversations):
    layout, root = request.param, tmp_path_factory.mktemp(request.param)
    if layout == "trtglm":
        repo = patch_repo(make_engine(root, "torch", fixture_dir), fixture_dir, root / "repo",
                          template=template_copy(root))
    else:
        repo = patch_repo(make_engine(root, "tensorrt", fixture_dir), fixture_dir, root / "repo",
                          template=upstream_copy(root, layout))
        as_python_backend(repo)
    replies = {json.dumps(chat_ids(tok, c["messages"])):
               tok.sp.encode("\n") + tok.sp.encode(c["answer"]) + [tok.special_ids["<|user|>"]] + tok.sp.encode("Hi")
               for c in conversations}
    replies.update({json.dumps(chat_ids(tok, [{"role": "user", "content": text}])):
                    tok.sp.encode(generated) + [tok.special_ids[stop]] for text, (generated, stop, _) in SCRIPTED.items()})
    (repo / "tensorrt_llm" / "1" / "script.json").write_text(json.dumps(replies))
    server = Server(repo, root)
    server.calls = repo / "tensorrt_llm" / "1" / "calls.jsonl"
    server.layout = layout
    yield server
    server.stop()


def chat(conversation: dict) -> str:
    return json.dumps({"messages": conversation["messages"]}, ensure_ascii=False)


def test_ensemble_answers_exactly(server, conversations, tok):
    for conversation in conversations:
        status, body = server.generate("ensemble", {"text_input": chat(conversation), "max_tokens": 64})
        assert status == 200, body
        assert body["text_output"] == conversation["answer"]
    call = json.loads(server.calls.read_text().splitlines()[-1])
    assert call["prompt"] == chat_ids(tok, conversations[-1]["messages"])
    assert (call["end_id"], call["pad_id"]) == (2, 0)
    assert call["stops"] == [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]]
    assert call["streaming"] is False


def test_ensemble_streams_exactly_with_a_python_engine_else_refuses(server, conversations):
    """trtglm's template rendered for a torch engine streams through the ensemble; NVIDIA's layouts rendered
    for a TensorRT engine (served here by the stand-in) refuse, pointing to tensorrt_llm_bls."""
    if server.layout != "trtglm":
        status, body = server.generate("ensemble", {"text_input": "hi", "max_tokens": 8, "stream": True})
        assert status >= 400 and "tensorrt_llm_bls" in body["error"]
        return
    for conversation in conversations:
        status, events = server.stream("ensemble", {"text_input": chat(conversation), "max_tokens": 64})
        assert status == 200 and not any("error" in e for e in events), events
        pieces = [e["text_output"] for e in events]
        assert "".join(pieces) == conversation["answer"]
        assert len(pieces) > 1 and not any("\ufffd" in p for p in pieces)
    assert json.loads(server.calls.read_text().splitlines()[-1])["streaming"] is True


def test_ensemble_bad_requests_get_errors(server):
    for text, message in (("", "text_input is empty"), ('[{"role": "robot", "content": "x"}]', "role must be one of")):
        status, body = server.generate("ensemble", {"text_input": text, "max_tokens": 8})
        assert status >= 400 and message in body["error"], body
    status, body = server.generate("ensemble", {"text_input": "hi " * 500, "max_tokens": 8})
    assert status >= 400 and "max_input_len" in body["error"]


def test_replies_follow_chatglm3s_chat_format_whole_and_streamed(server):
    """The chat rules `trtglm chat` applies too: text that is JSON but no chat is a user message, a reply is
    stripped, a tool call keeps its name line, an empty chat is an error."""
    streams = ("tensorrt_llm_bls", "ensemble") if server.layout == "trtglm" else ("tensorrt_llm_bls",)
    for text, (_, _, expected) in SCRIPTED.items():
        for model in ("ensemble", "tensorrt_llm_bls"):
            status, body = server.generate(model, {"text_input": text, "max_tokens": 64})
            assert status == 200 and body["text_output"] == expected, (model, body)
        for model in streams:
            status, events = server.stream(model, {"text_input": text, "max_tokens": 64})
            assert status == 200 and "".join(e.get("text_output", "") for e in events) == expected, (model, events)
    for text, message in (('{"messages": []}', 'text_input: "messages" must be a non-empty list'),
                          ("[]", "text_input is an empty chat")):
        for model in ("ensemble", "tensorrt_llm_bls"):
            status, body = server.generate(model, {"text_input": text, "max_tokens": 8})
            assert status >= 400 and message in body["error"], (model, body)


def test_bls_answers_exactly_whole_and_streamed(server, conversations):
    for conversation in conversations:
        status, body = server.generate("tensorrt_llm_bls", {"text_input": chat(conversation), "max_tokens": 64})
        assert status == 200 and body["text_output"] == conversation["answer"], body
        status, events = server.stream("tensorrt_llm_bls", {"text_input": chat(conversation), "max_tokens": 64})
        assert status == 200 and not any("error" in e for e in events), events
        pieces = [e["text_output"] for e in events if "text_output" in e]
        assert "".join(pieces) == conversation["answer"]
        assert len(pieces) > 1 and not any("\ufffd" in p for p in pieces)


def test_bls_stream_errors_arrive_as_events(server):
    status, events = server.stream("tensorrt_llm_bls", {"text_input": "hi", "max_tokens": 0})
    assert [e.get("error") for e in events] == ["max_tokens must be between 1 and 2147483647, not 0"]
    assert status == 400  # Triton turns an error that comes first into the HTTP status
