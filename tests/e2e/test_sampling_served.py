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
from trtglm.request_config import SamplingConfig
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
                            sampling=SamplingConfig(**sampling)), outputs.append)
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


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_trtglm_generate_prints_both_beams(served, conversation, transport):
    text = json.dumps({"messages": conversation["messages"]}, ensure_ascii=False)
    where = ("--url", served.url) if transport == "http" else ("--grpc", served.grpc)
    done = served.run("generate", *where, "--prompt", text, "--max-tokens", str(MAX_TOKENS), "--beam-width", "2")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "\n".join(expected_beams(served, conversation["messages"])) + "\n"


def test_tensorrt_llm_answers_every_beam_in_nvidias_tensors(served, conversation):
    """Straight to tensorrt_llm: output_ids [1, beams, longest] (the shorter beam padded with -1), sequence_length
    and cum_log_probs [1, beams], as NVIDIA's backend gives them."""
    tok = ChatGLMTokenizer(FIXTURE)
    prompt = chat_ids(tok, conversation["messages"])
    status, body = generate(served.url, "tensorrt_llm", {
        "input_ids": prompt, "input_lengths": len(prompt), "request_output_len": MAX_TOKENS, "beam_width": 2,
        "end_id": tok.eos_id, "stop_words_list": [518, 520, 1, 2], "return_log_probs": True})
    assert status == 200, body
    model = load_model(served.root / "engine" / "checkpoint")
    beams = beam_search(model, prompt, 2, MAX_TOKENS, end_id=tok.eos_id, stop_words=served_stops(tok))
    longest = max(len(b.tokens) for b in beams)
    assert body["output_ids"] == [t for b in beams for t in b.tokens + [-1] * (longest - len(b.tokens))]
    assert body["sequence_length"] == [len(b.tokens) for b in beams]
    assert body["cum_log_probs"] == pytest.approx([b.cum_log_prob for b in beams], abs=1e-4)


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
    seeds = (5, 7, 11)
    replies = {seed: [generate(served.url, "ensemble", {"text_input": text, "max_tokens": MAX_TOKENS, **sampled,
                                                        "random_seed": seed})[1]["text_output"] for _ in range(2)]
               for seed in seeds}
    assert all(replies[seed][0] == replies[seed][1] for seed in seeds)
    assert len({replies[seed][0] for seed in seeds} | {conversation["answer"]}) > 2  # sampled, not greedy
    for seed in seeds:
        assert replies[seed][0] == expected_sampled(served, conversation["messages"], seed=seed, **sampled)
