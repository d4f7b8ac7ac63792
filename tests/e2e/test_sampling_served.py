"""Sampling and beam search served, over HTTP generate, against the in-process runtime (itself checked against
transformers in tests/runtime/test_beams.py and test_sampling_parity.py) with the served end id and stop words:
an engine built with max_beam_width 2 answers beam_width 2 with both beams, best first, through the ensemble and
the BLS model; wider beams and streamed beams are refused with one line, and the server goes on serving; a
random_seed gives the same sampled reply every time, the one the in-process executor gives with that seed."""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import FIXTURE
from support.servers import NO_PROXY, launched_server

from trtglm.backend.engine import engine_info
from trtglm.chatglm.chat import chat_ids, reply_text
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.runtime.executor import Executor, Request
from trtglm.runtime.generate import beam_search
from trtglm.runtime.model import load_model
from trtglm.runtime.slot_runtime import ShardedSlotModel

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


@pytest.fixture(scope="module")
def conversation() -> dict:
    return json.loads((FIXTURE / "conversations.jsonl").read_text().splitlines()[0])


def served_stops(tok: ChatGLMTokenizer) -> list[list[int]]:
    return [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]]


def expected_beams(served, messages: list[dict]) -> list[str]:
    tok = ChatGLMTokenizer(FIXTURE)
    model = load_model(served.root / "engine" / "checkpoint")
    beams = beam_search(model, chat_ids(tok, messages), 2, MAX_TOKENS, end_id=tok.eos_id, stop_words=served_stops(tok))
    return [reply_text(tok, beam.tokens) for beam in beams]


def expected_sampled(served, messages: list[dict], **sampling) -> str:
    tok, engine = ChatGLMTokenizer(FIXTURE), served.root / "engine"
    executor = Executor(ShardedSlotModel(load_model(engine / "checkpoint"), 1, 512),
                        vocab_limit=engine_info(engine).tokenizer_size)
    outputs = []
    executor.submit(Request(chat_ids(tok, messages), MAX_TOKENS, end_id=tok.eos_id, stop_words=served_stops(tok),
                            **sampling), outputs.append)
    while executor.has_work():
        executor.step()
    return reply_text(tok, [t for output in outputs for t in output.tokens])


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_beam_width_2_returns_both_beams(served, conversation, model):
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


def test_a_random_seed_gives_the_same_sampled_reply_as_in_process(served, conversation):
    text = json.dumps({"messages": conversation["messages"]}, ensure_ascii=False)
    sampled = {"temperature": 3.0, "top_k": 40}
    replies = {seed: [generate(served.url, "ensemble", {"text_input": text, "max_tokens": MAX_TOKENS, **sampled,
                                                        "random_seed": seed})[1]["text_output"] for _ in range(2)]
               for seed in (5, 6)}
    assert replies[5][0] == replies[5][1] and replies[6][0] == replies[6][1]
    assert replies[5][0] != replies[6][0] and conversation["answer"] not in (replies[5][0], replies[6][0])
    for seed in (5, 6):
        assert replies[seed][0] == expected_sampled(served, conversation["messages"], seed=seed, **sampled)
