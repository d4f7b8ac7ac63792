"""The chatglm3-6b history model's request to the engine: the kept turns' ChatGLM3 prompt (ids written out
by hand for the fixture's tokenizer), a reply budget of max_token less the prompt (as chat(max_length=…)),
the client's temperature, ChatGLM3's stop words; bad values are one-line errors."""

from __future__ import annotations

import pytest

from trtglm.backend.history_chat import engine_request, request_turns, temperature_value
from trtglm.backend.preprocessing import Limits
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

LIMITS = Limits(max_input_len=384, max_seq_len=512, vocab_size=576)
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
    inputs = engine_request(tok, LIMITS, turns, max_token=100, temperature=0.5)
    ids = expected_ids(tok, ("user", "hi"), ("assistant", "Hello"), ("user", "Say it again."))
    assert inputs["input_ids"].tolist() == [ids]
    assert inputs["request_output_len"].tolist() == [[100 - len(ids)]]
    assert inputs["temperature"].tolist() == [[0.5]]
    assert inputs["end_id"].tolist() == [[2]]
    stops = inputs["stop_words_list"][0]
    assert stops[0, :2].tolist() == [tok.special_ids["<|user|>"], tok.special_ids["<|observation|>"]]


def test_history_len_zero_sends_the_prompt_alone(tok):
    turns, kept = request_turns("hi", [HISTORY], history_len=0)
    assert kept == []
    assert engine_request(tok, LIMITS, turns, 64, 0.0)["input_ids"].tolist() == [expected_ids(tok, ("user", "hi"))]


def test_max_token_must_leave_room_for_a_reply(tok):
    turns, _ = request_turns("hi", [""], 0)
    prompt_len = len(expected_ids(tok, ("user", "hi")))
    with pytest.raises(UsageError, match=f"max_token {prompt_len} leaves no room for a reply: the prompt and "
                                         f"history are {prompt_len} tokens"):
        engine_request(tok, LIMITS, turns, prompt_len, 0.0)
    with pytest.raises(UsageError, match="max_token must be 1 or more, not 0"):
        engine_request(tok, LIMITS, turns, 0, 0.0)


@pytest.mark.parametrize("text, value", [("0", 0.0), ("0.95", 0.95), (" 1e-2 ", 0.01)])
def test_temperature_is_a_number_as_text(text, value):
    assert temperature_value(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["warm", "", "-1", "nan", "inf"])
def test_other_temperatures_are_refused(text):
    with pytest.raises(UsageError, match="temperature must be"):
        temperature_value(text)


def test_an_empty_prompt_is_refused():
    with pytest.raises(UsageError, match="prompt is empty"):
        request_turns("  ", [], 1)
