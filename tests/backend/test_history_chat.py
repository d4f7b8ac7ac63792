"""The chatglm3-6b history model's request to the engine: the kept turns' ChatGLM3 prompt (ids written out
by hand for the fixture's tokenizer), a reply budget of max_token less the prompt (as chat(max_length=…)),
the client's temperature and top_p (sampled, by its seed), ChatGLM3's stop words; bad values are one-line errors."""

from __future__ import annotations

import pytest

from trtglm.backend.contract import Limits
from trtglm.backend.history_chat import history_engine_inputs, request_turns, sampling_config
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

LIMITS = Limits(max_input_len=384, max_seq_len=512, vocab_size=576)
GREEDY = sampling_config("0", None, None)
HISTORY = "[{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'metadata': '', 'content': 'Hello'}]"


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


def expected_ids(tok: ChatGLMTokenizer, *turns: tuple[str, str]) -> list[int]:
    """[gMASK] sop, then <|role|> + "\\n" + content per turn, then <|assistant|> (ChatGLM3's build_chat_input)."""
    special, ids = tok.special_ids, [tok.special_ids["[gMASK]"], tok.special_ids["sop"]]
    for role, content in turns:
        ids += [special[f"<|{role}|>"], *tok.sp.encode("\n"), *tok.sp.encode(content)]
    return ids + [special["<|assistant|>"]]


def test_the_engine_gets_the_kept_turns_prompt_and_what_max_token_leaves(tok):
    turns, kept = request_turns("Say it again.", [HISTORY], history_len=1)
    inputs = history_engine_inputs(tok, LIMITS, turns, max_token=100, sampling=sampling_config("0.5", None, None))
    ids = expected_ids(tok, ("user", "hi"), ("assistant", "Hello"), ("user", "Say it again."))
    assert inputs["input_ids"].tolist() == [ids]
    assert inputs["request_output_len"].tolist() == [[100 - len(ids)]]
    # sampled: TensorRT-LLM samples only with runtime_top_k or runtime_top_p above 0 (temperature alone is greedy)
    assert (inputs["temperature"].tolist(), inputs["runtime_top_k"].tolist(), inputs["runtime_top_p"].tolist()) == (
        [[0.5]], [[0]], [[1.0]])
    assert inputs["end_id"].tolist() == [[2]]
    stops = inputs["stop_words_list"][0]
    assert stops[0, :2].tolist() == [tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]]


def test_history_len_zero_sends_the_prompt_alone(tok):
    turns, kept = request_turns("hi", [HISTORY], history_len=0)
    assert kept == []
    inputs = history_engine_inputs(tok, LIMITS, turns, 64, GREEDY)
    assert inputs["input_ids"].tolist() == [expected_ids(tok, ("user", "hi"))]


def test_max_token_must_leave_room_for_a_reply(tok):
    turns, _ = request_turns("hi", [""], 0)
    prompt_len = len(expected_ids(tok, ("user", "hi")))
    with pytest.raises(UsageError, match=f"max_token {prompt_len} leaves no room for a reply: the prompt and "
                                         f"history are {prompt_len} tokens"):
        history_engine_inputs(tok, LIMITS, turns, prompt_len, GREEDY)
    with pytest.raises(UsageError, match="^max_token must be between 1 and 32767, not 0$"):
        history_engine_inputs(tok, LIMITS, turns, 0, GREEDY)
    # INT16 over HTTP JSON: 40000 arrives as -25536
    with pytest.raises(UsageError, match=r"^max_token must be between 1 and 32767, not -25536 \(over HTTP JSON Triton "
                                         r"keeps only the low 16 bits of a larger number: 40000 arrives as -25536\)$"):
        history_engine_inputs(tok, LIMITS, turns, -25536, GREEDY)


@pytest.mark.parametrize("text, value", [("0", 0.0), ("0.95", 0.95), (" 1e-2 ", 0.01)])
def test_temperature_is_a_number_as_text(text, value):
    assert sampling_config(text, None, None).temperature == pytest.approx(value)


@pytest.mark.parametrize("text", ["warm", "", "-1", "nan", "inf"])
def test_other_temperatures_are_refused(text):
    with pytest.raises(UsageError, match="^temperature must be"):
        sampling_config(text, None, None)


def test_top_p_and_seed_reach_the_engine(tok):
    turns, _ = request_turns("hi", [""], 0)
    inputs = history_engine_inputs(tok, LIMITS, turns, 64, sampling_config("0.8", "0.5", 7))
    assert (inputs["runtime_top_p"].tolist(), inputs["random_seed"].tolist()) == ([[0.5]], [[7]])
    greedy = history_engine_inputs(tok, LIMITS, turns, 64, GREEDY)
    assert not {"temperature", "runtime_top_k", "runtime_top_p"} & set(greedy)


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "nan", "high"])
def test_other_top_ps_are_refused(text):
    with pytest.raises(UsageError, match="^top_p must be"):
        sampling_config("1", text, None)


def test_an_empty_prompt_is_refused():
    with pytest.raises(UsageError, match="prompt is empty"):
        request_turns("  ", [], 1)
