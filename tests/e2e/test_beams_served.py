"""Beam search served: an engine built with max_beam_width 2 answers beam_width 2 over HTTP generate with both
beams, best first, through the ensemble and the BLS model, each beam's text what the in-process beam search
(checked against transformers in tests/runtime/test_beams.py) gives with the served end id and stop words;
wider beams and streamed beams are refused with one line, and the server goes on serving."""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import FIXTURE
from support.servers import NO_PROXY, launched_server

from trtglm.chatglm.chat import chat_ids, reply_text
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.runtime.generate import beam_search
from trtglm.runtime.model import load_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from launched_server(tmp_path_factory.mktemp("beams-served"), ("--set", "build.max_beam_width=2"))


def generate(url: str, model: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with NO_PROXY.open(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def expected_beams(served, messages: list[dict]) -> list[str]:
    tok = ChatGLMTokenizer(FIXTURE)
    model = load_model(served.root / "engine" / "checkpoint")
    stops = [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]]
    beams = beam_search(model, chat_ids(tok, messages), 2, MAX_TOKENS, end_id=tok.eos_id, stop_words=stops)
    return [reply_text(tok, beam.tokens) for beam in beams]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_beam_width_2_returns_both_beams(served, model):
    conversation = json.loads((FIXTURE / "conversations.jsonl").read_text().splitlines()[0])
    text = json.dumps({"messages": conversation["messages"]}, ensure_ascii=False)
    status, body = generate(served.url, model, {"text_input": text, "max_tokens": MAX_TOKENS, "beam_width": 2})
    assert status == 200, body
    expected = expected_beams(served, conversation["messages"])
    assert body["text_output"] == expected and len(set(expected)) == 2
    assert expected[0] == conversation["answer"]  # the best beam is the fixture's answer
    status, body = generate(served.url, model, {"text_input": text, "max_tokens": MAX_TOKENS})
    assert status == 200 and body["text_output"] == conversation["answer"]  # one beam: greedy, as before


def test_too_wide_or_streamed_beams_are_refused_in_one_line(served):
    status, body = generate(served.url, "ensemble", {"text_input": "hi", "max_tokens": 8, "beam_width": 3})
    assert status >= 400 and "beam_width 3 is outside 1..2 (the engine's max_beam_width)" in body["error"]
    request = urllib.request.Request(f"{served.url}/v2/models/ensemble/generate_stream", method="POST",
                                     data=json.dumps({"text_input": "hi", "max_tokens": 8, "beam_width": 2,
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with NO_PROXY.open(request, timeout=60) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as e:
        text = e.read().decode()
    assert "streaming takes beam_width 1, not 2 (as TensorRT-LLM's backend)" in text
    status, body = generate(served.url, "ensemble", {"text_input": "hi", "max_tokens": 8})
    assert status == 200 and body["text_output"]
