"""`trtglm generate` and trtglm.client.

First against a small real HTTP server started here (http.server on a loopback port) that
answers with canned bodies the way Triton's generate extension does (trtllm.md §5): JSON for
/generate, chunked `text/event-stream` for /generate_stream, `{"error": …}` with an error
status. It records what the client sent. Then end to end against a launched server of the
fixture's engine, whose answers are the fixture's conversations (conversations.jsonl).
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import FIXTURE, REPO, run_cli
from support.servers import fixture_answers, free_port, launched_server

from trtglm.client import GenerateRequest, ServerError
from trtglm.client.http import generate, generate_stream, sse_data
from trtglm.client.openai_chat import OpenAIChat
from trtglm.errors import UsageError

PROMPT = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


# --- a canned HTTP server -------------------------------------------------------------------------


@dataclass
class Reply:
    """What the canned server answers on one path: a status and body chunks, sent chunked.

    A chunk `None` stands for a pause until the test opens `gate` (or 10 s pass).
    """

    status: int
    chunks: list[bytes | None]
    content_type: str = "application/json"
    ends: bool = True  # False: the connection drops after the chunks, as when the server dies mid-stream


@dataclass
class Canned:
    replies: dict[str, Reply] = field(default_factory=dict)
    received: list[tuple[str, bytes]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    gate_timed_out: bool = False


def json_reply(status: int, value: dict) -> Reply:
    return Reply(status, [json.dumps(value, ensure_ascii=False).encode()])


def sse_reply(*chunks: bytes | None, status: int = 200) -> Reply:
    return Reply(status, list(chunks), "text/event-stream; charset=utf-8")


def event(value: dict) -> bytes:
    return b"data: " + json.dumps(value, ensure_ascii=False).encode() + b"\n\n"


def make_handler(canned: Canned):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.do_POST()

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            canned.received.append((self.path, body))
            reply = canned.replies.get(self.path, json_reply(404, {"error": f"no canned reply for {self.path}"}))
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in reply.chunks:
                if chunk is None:
                    canned.gate_timed_out |= not canned.gate.wait(10)
                    continue
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            if reply.ends:
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def canned():
    state = Canned()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    state.gate.set()
    server.shutdown()
    server.server_close()


def sent(canned: Canned) -> list[tuple[str, dict | None]]:
    return [(path, json.loads(body) if body else None) for path, body in canned.received]


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli("generate", *args, timeout=60)


# --- server-sent events ---------------------------------------------------------------------------


def test_sse_data_follows_the_event_stream_format():
    lines = [b": a comment\r\n", b"data: {\"a\": 1}\r\n", b"\r\n",
             b"event: message\n", b"data:{\"b\": 2}\n", b"id: 7\n", b"\n",
             b"data: first line\n", b"data: second line\n", b"\n", b"\n",
             b"data: \xe5\xa4\xa9\xe7\xa9\xba\n"]  # the last event is not closed by a blank line
    assert list(sse_data(lines)) == ['{"a": 1}', '{"b": 2}', "first line\nsecond line", "天空"]


def test_stream_pieces_arrive_before_the_stream_ends(canned):
    """Each event is handed over when it arrives, across chunks that split lines and characters."""
    first = event({"text_output": "天空", "model_name": "ensemble"})
    cut = first.index("空".encode()) + 1  # inside the second character's UTF-8 bytes
    canned.replies["/v2/models/tensorrt_llm_bls/generate_stream"] = sse_reply(
        first[:cut], first[cut:], None, event({"text_output": "是蓝色的", "cum_log_probs": -1.0})[:9],
        event({"text_output": "是蓝色的", "cum_log_probs": -1.0})[9:], event({"cum_log_probs": -2.0}),
        event({"text_output": "。"}))
    pieces = generate_stream(canned.url, "tensorrt_llm_bls", GenerateRequest("天空是什么颜色？", 16, stream=True),
                             timeout=20)
    assert next(pieces) == "天空"
    canned.gate.set()
    assert list(pieces) == ["是蓝色的", "。"]
    assert not canned.gate_timed_out, "the first piece was only handed over after the stream ended"
    assert sent(canned) == [("/v2/models/tensorrt_llm_bls/generate_stream",
                             {"text_input": "天空是什么颜色？", "max_tokens": 16, "stream": True})]


def test_an_error_event_inside_a_200_stream_raises(canned):
    canned.replies["/v2/models/tensorrt_llm_bls/generate_stream"] = sse_reply(
        event({"text_output": "The"}), event({"error": "engine failed\nat step 3"}))
    pieces = generate_stream(canned.url, "tensorrt_llm_bls", GenerateRequest("hi", 8, stream=True))
    assert next(pieces) == "The"
    with pytest.raises(ServerError, match="^engine failed at step 3$"):
        next(pieces)


def test_a_stream_that_breaks_off_raises_instead_of_ending(canned):
    """A server that dies mid-stream sends no final chunk: the reply is incomplete, and said so."""
    canned.replies["/v2/models/ensemble/generate_stream"] = Reply(
        200, [event({"text_output": "The"}), event({"text_output": " capital"})], "text/event-stream", ends=False)
    pieces = generate_stream(canned.url, "ensemble", GenerateRequest("hi", 8, stream=True), timeout=20)
    assert next(pieces) == "The" and next(pieces) == " capital"
    with pytest.raises(ServerError, match="broke off"):
        next(pieces)


def test_error_bodies_become_one_line_errors(canned):
    canned.replies["/v2/models/ensemble/generate"] = json_reply(400, {"error": "max_tokens must be\nat least 1"})
    canned.replies["/v2/models/ensemble/generate_stream"] = sse_reply(event({"error": "streaming refused"}),
                                                                      status=400)
    canned.replies["/v2/models/other/generate"] = Reply(503, [b"<html>busy</html>\n<p>later</p>"], "text/html")
    with pytest.raises(ServerError) as whole:
        generate(canned.url, "ensemble", GenerateRequest("hi", 8))
    assert str(whole.value) == "ensemble: max_tokens must be at least 1 (HTTP 400)"
    with pytest.raises(ServerError) as streamed:
        list(generate_stream(canned.url, "ensemble", GenerateRequest("hi", 8, stream=True)))
    assert str(streamed.value) == "ensemble: streaming refused (HTTP 400)"
    with pytest.raises(ServerError) as other:
        generate(canned.url, "other", GenerateRequest("hi", 8))
    assert str(other.value) == "other: <html>busy</html> (HTTP 503)"


def test_answers_that_are_not_what_triton_sends_are_errors(canned):
    canned.replies["/v2/models/ensemble/generate"] = Reply(200, [b"not json"])
    canned.replies["/v2/models/m/generate"] = json_reply(200, {"model_name": "m"})
    with pytest.raises(ServerError, match="not JSON"):
        generate(canned.url, "ensemble", GenerateRequest("hi", 8))
    with pytest.raises(ServerError, match="no text_output"):
        generate(canned.url, "m", GenerateRequest("hi", 8))


# --- request checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"max_tokens": -1}, "--max-tokens must be a whole number from 1 to 2147483647 (Triton's INT32), not -1"),
    ({"max_tokens": 0}, "--max-tokens must be a whole number from 1 to 2147483647 (Triton's INT32), not 0"),
    ({"max_tokens": 2.5}, "--max-tokens must be a whole number from 1 to 2147483647 (Triton's INT32), not 2.5"),
    ({"text": ""}, "--prompt must be non-empty text"),
    ({"temperature": -0.1}, "--temperature must be a number ≥ 0"),
    ({"top_k": -1}, "--top-k must be a whole number from 0 to 2147483647"),
    ({"max_tokens": 2**31}, "--max-tokens must be a whole number from 1 to 2147483647"),
    ({"top_p": 0}, "--top-p must be a number in (0, 1]"),
    ({"top_p": 1.5}, "--top-p must be a number in (0, 1]"),
    ({"seed": 2**64}, "--seed must be a whole number in [0, 2^64)"),
    ({"seed": True}, "--seed must be a whole number"),
    ({"beam_width": 0}, "--beam-width must be a whole number from 1 to 2147483647, not 0"),
])
def test_bad_requests_are_refused_before_sending(options, message):
    with pytest.raises(UsageError) as refused:
        GenerateRequest(**{"text": "hi", "max_tokens": 8, **options})
    assert str(refused.value).startswith(message)


def test_only_the_options_given_are_sent():
    assert GenerateRequest("hi", 8).inputs() == {"text_input": "hi", "max_tokens": 8, "stream": False}
    assert GenerateRequest("hi", 8, True, 0.5, 3, 0.9, 7).inputs() == {
        "text_input": "hi", "max_tokens": 8, "stream": True, "temperature": 0.5, "top_k": 3, "top_p": 0.9,
        "random_seed": 7}


# --- the command, against the canned server -------------------------------------------------------


def test_generate_prints_the_answer_and_sends_the_options(canned):
    chat = json.dumps([{"role": "system", "content": "You answer in Chinese."},
                       {"role": "user", "content": "What color is the sky?"}], ensure_ascii=False)
    canned.replies["/v2/models/ensemble/generate"] = json_reply(
        200, {"model_name": "ensemble", "model_version": "1", "text_output": "天空是蓝色的。", "cum_log_probs": -1.0})
    done = cli("--url", canned.url, "--prompt", chat, "--max-tokens", "12", "--temperature", "0.5",
               "--top-k", "3", "--top-p", "0.9", "--seed", "7")
    assert (done.returncode, done.stdout, done.stderr) == (0, "天空是蓝色的。\n", "")
    assert sent(canned) == [("/v2/models/ensemble/generate",
                             {"text_input": chat, "max_tokens": 12, "stream": False, "temperature": 0.5,
                              "top_k": 3, "top_p": 0.9, "random_seed": 7})]


def test_generate_prints_every_beam_on_a_line_of_its_own(canned):
    canned.replies["/v2/models/ensemble/generate"] = json_reply(200, {"text_output": ["The sky is blue.",
                                                                                     "The sky is grey."]})
    done = cli("--url", canned.url, "--prompt", "hi", "--beam-width", "2")
    assert (done.returncode, done.stdout) == (0, "The sky is blue.\nThe sky is grey.\n")
    assert sent(canned)[0][1]["beam_width"] == 2


def test_prompts_that_look_like_other_values_stay_text(canned):
    canned.replies["/v2/models/ensemble/generate"] = json_reply(200, {"text_output": "ok"})
    for prompt in ("007", "[1, 2]", "True", "{'a': 1}", "1e3"):
        assert cli("--url", canned.url, "--prompt", prompt).returncode == 0
    assert [body["text_input"] for _, body in sent(canned)] == ["007", "[1, 2]", "True", "{'a': 1}", "1e3"]


def test_generate_stream_prints_each_piece_as_it_arrives(canned):
    canned.replies["/v2/models/tensorrt_llm_bls/generate_stream"] = sse_reply(
        event({"text_output": "The capital"}), None, event({"text_output": " of France"}),
        event({"text_output": " is Paris."}))
    proc = subprocess.Popen([sys.executable, "-m", "trtglm", "generate", "--url", canned.url, "--prompt", PROMPT,
                             "--model", "tensorrt_llm_bls", "--stream"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    try:
        assert read_until(proc, b"The capital", limit_s=30) == b"The capital"
    finally:
        canned.gate.set()
        out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (0, b" of France is Paris.\n", b"")
    assert not canned.gate_timed_out
    assert sent(canned)[0][1]["stream"] is True


def read_until(proc: subprocess.Popen, wanted: bytes, limit_s: float) -> bytes:
    """What the process printed, once it holds `wanted` (or when `limit_s` has passed)."""
    got, deadline = b"", time.monotonic() + limit_s
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while wanted not in got and time.monotonic() < deadline:
            if selector.select(timeout=0.2):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                got += chunk
    return got


def test_errors_are_one_line_and_a_non_zero_exit(canned):
    canned.replies["/v2/models/ensemble/generate"] = json_reply(400, {"error": "in ensemble 'ensemble', "
                                                                               "the prompt is too long"})
    canned.replies["/v2/models/tensorrt_llm_bls/generate_stream"] = sse_reply(
        event({"text_output": "The capital"}), event({"error": "request cancelled"}))
    refused = cli("--url", canned.url, "--prompt", "hi")
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == "trtglm: error: ensemble: in ensemble 'ensemble', the prompt is too long (HTTP 400)\n"

    broken = cli("--url", canned.url, "--prompt", "hi", "--model", "tensorrt_llm_bls", "--stream")
    assert (broken.returncode, broken.stdout) == (1, "The capital\n")
    assert broken.stderr == "trtglm: error: request cancelled\n"

    closed = f"http://127.0.0.1:{free_port()}"
    unreachable = cli("--url", closed, "--prompt", "hi")
    assert unreachable.returncode == 1
    assert unreachable.stderr == f"trtglm: error: cannot reach Triton at {closed}: Connection refused\n"

    asked = len(canned.received)
    for args, message in ((("--max-tokens", "-3"), "--max-tokens must be a positive whole number, not '-3'"),
                          (("--model", "../x"), "--model must be a model name"),
                          (("--url", "ftp://host:1"), "--url ftp://host:1: expected http://HOST:PORT"),
                          (("--grpc", "nohost"), "--grpc nohost: expected HOST:PORT")):
        bad = cli("--url", canned.url, "--prompt", "hi", *args)
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith(f"trtglm: error: {message}") and bad.stderr.count("\n") == 1, bad.stderr
    assert len(canned.received) == asked  # refused before anything was sent


# --- the OpenAI chat API (trtglm chat --openai), against the canned server -----------------------------

SKY_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the sky?"}]


def chunk(delta: dict | None, finish: str | None = None) -> bytes:
    """One chunk as OpenAI's streamed chat completions send it (no choices: a usage chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny", "choices": choices})


def test_openai_chat_sends_the_conversation_and_streams_the_deltas(canned):
    canned.replies["/v1/models"] = json_reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
    canned.replies["/v1/chat/completions"] = sse_reply(
        chunk({"role": "assistant", "content": ""}), chunk({"content": "The sky"}), None, chunk({"content": " is blue."}),
        chunk({}, "stop"), chunk(None), b"data: [DONE]\n\n")
    pieces = OpenAIChat(f"{canned.url}/v1", None, 32, 0.0, None, 7, timeout=20).pieces(SKY_CHAT)
    assert next(pieces) == "The sky"
    canned.gate.set()
    assert list(pieces) == [" is blue."] and not canned.gate_timed_out
    assert sent(canned) == [("/v1/models", None), ("/v1/chat/completions", {
        "model": "tiny", "messages": SKY_CHAT, "stream": True, "max_tokens": 32, "temperature": 0.0, "seed": 7})]


def test_openai_chat_errors_are_one_line(canned):
    canned.replies["/api/v1/models"] = json_reply(200, {"data": [{"id": "a"}, {"id": "b"}]})
    with pytest.raises(ServerError, match=r"lists the models \['a', 'b'\]: name one with --model$"):
        OpenAIChat(f"{canned.url}/api/v1", None, 8, 0.0, None, None, timeout=20)
    chat = OpenAIChat(canned.url, "tiny", 8, 0.0, None, None, timeout=20)  # /v1 added
    cases = [
        (json_reply(400, {"error": {"message": "the prompt is\ntoo long", "type": "invalid_request_error"}}),
         r"^the prompt is too long \(HTTP 400\)$"),
        (Reply(502, [b"Bad Gateway\n<html>"], "text/html"), r"^/v1/chat/completions: Bad Gateway \(HTTP 502\)$"),
        (sse_reply(chunk({"content": "The"}), event({"error": {"message": "the model server failed"}}),
                   b"data: [DONE]\n\n"), r"^the model server failed$"),
        (sse_reply(chunk({"content": "The"})), r"ended without \[DONE\]$"),
    ]
    for reply, message in cases:
        canned.replies["/v1/chat/completions"] = reply
        with pytest.raises(ServerError, match=message):
            list(chat.pieces(SKY_CHAT))


# --- end to end: a launched server of the fixture's engine ------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from launched_server(tmp_path_factory.mktemp("client-served"))


QUESTIONS = ("What is the capital of France?", "天空是什么颜色？")
TRANSPORTS = {
    "http": lambda s: ("--url", s.url),
    "http-stream": lambda s: ("--url", s.url, "--stream"),
    "http-bls-stream": lambda s: ("--url", s.url, "--model", "tensorrt_llm_bls", "--stream"),
    "grpc": lambda s: ("--grpc", s.grpc),
    "grpc-stream": lambda s: ("--grpc", s.grpc, "--stream"),
    "grpc-bls-stream": lambda s: ("--grpc", s.grpc, "--model", "tensorrt_llm_bls", "--stream"),
}


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_served_answers_are_the_fixture_answers(served, transport):
    answers = fixture_answers()
    for question in QUESTIONS:
        done = cli(*TRANSPORTS[transport](served), "--prompt", question, "--max-tokens", "48")
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout == answers[question] + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_served_streams_come_in_pieces(served, model):
    from trtglm.client.grpc import generate_stream as grpc_stream

    answers = fixture_answers()
    for question in ("三个水是什么字？", "List two colors."):
        request = GenerateRequest(question, 48, stream=True)
        for stream in (generate_stream(served.url, model, request), grpc_stream(served.grpc, model, request)):
            pieces = list(stream)
            assert len(pieces) > 1 and "".join(pieces) == answers[question], pieces


@pytest.mark.slow
def test_served_chat_history_and_errors(served):
    history = [{"role": "user", "content": "My name is Alice."},
               {"role": "assistant", "content": "Nice to meet you, Alice."},
               {"role": "user", "content": "What is my name?"}]
    done = cli("--url", served.url, "--prompt", json.dumps({"messages": history}))
    assert (done.returncode, done.stdout) == (0, "Your name is Alice.\n"), done.stderr
    long = cli("--grpc", served.grpc, "--prompt", "hi " * 600, "--max-tokens", "8")
    assert long.returncode == 1 and "max_input_len" in long.stderr and long.stderr.count("\n") == 1, long.stderr
    missing = cli("--url", served.url, "--prompt", "hi", "--model", "no_such_model")
    assert missing.returncode == 1
    assert missing.stderr.startswith("trtglm: error: no_such_model: ") and missing.stderr.count("\n") == 1


# --- the serving benchmark, against the same server -----------------------------------------------


@pytest.mark.slow
def test_bench_serving_measures_the_served_fixture(served, tmp_path):
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer

    done = run_cli("bench", "serving", "--url", served.url, "--concurrency", "1,4", "--requests", "6",
                   "--repeats", "3", "--max-tokens", "32", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "serving.json").read_text())
    tokenizer = ChatGLMTokenizer(FIXTURE)
    # the fixture replies "\n", the answer, then <|user|> (a stop word, which the engine returns)
    expected_tokens = len(tokenizer.sp.encode("\n")) + len(tokenizer.sp.encode(ANSWER)) + 1
    assert (results["reply"], results["reply_tokens"], results["served_reply_matches"]) == (ANSWER, expected_tokens,
                                                                                             True)
    overhead = results["overhead"]
    assert overhead["calls"] == 5  # whole blocks of 5
    assert overhead["served"]["differing_replies"] == overhead["in_process"]["differing_replies"] == 0
    assert overhead["overhead_ms"]["median"] == round(overhead["served"]["ms"]["median"]
                                                      - overhead["in_process"]["ms"]["median"], 2)
    assert [row["concurrency"] for row in results["throughput"]] == [1, 4]
    for row in results["throughput"]:
        assert (row["requests"], row["failed"], row["differing_replies"]) == (6, 0, 0)
        assert row["tokens_per_s"] == pytest.approx(expected_tokens * 6 / row["wall_s"], rel=0.01)
        assert 0 < row["latency_ms"]["median"] <= row["latency_ms"]["p90"] <= row["latency_ms"]["max"]
    assert results["command"].startswith(f"trtglm bench serving --url {served.url} --model ensemble")
    assert results["machine"]["nproc"] >= 1 and results["machine"]["memory_gib"] > 0
    assert done.stdout == (tmp_path / "serving.md").read_text()
    assert "| 4 | 6 |" in done.stdout


def test_bench_refuses_bad_flags():
    for args, message in ((("nonsense",), "unknown kind 'nonsense'"),
                          (("serving", "--concurrency", "0,8"), "--concurrency must be whole numbers ≥ 1"),
                          (("serving", "--requests", "0"), "--requests must be a positive whole number"),
                          (("serving", "--url", "ftp://x"), "--url ftp://x: expected http://HOST:PORT")):
        refused = run_cli("bench", *args, timeout=60)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith("trtglm") and message in refused.stderr
        assert refused.stderr.count("\n") == 1
