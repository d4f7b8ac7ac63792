"""ChatGLM3's chat format (trtglm.chatglm.chat): messages, prompt ids, stop rules, word lists, reply
text whole and streamed, tool calls.

Expected prompt ids are computed from raw `sentencepiece` calls and ChatGLM3's documented
layout (`[gMASK] sop`, `<|role|>` + encode(metadata + "\\n") + encode(content) per message,
`<|assistant|>`); word lists are written out in TensorRT-LLM's documented [2, n] layout; reply
text follows ChatGLM3's `process_response` (a plain reply's content stripped).
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from support.tokenizer import answers, sp, special, tok  # noqa: F401 (fixtures)

from trtglm.chatglm import chat
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

CALL = "```python\ntool_call(city='Beijing')\n```"


def user_prompt(sp, text: str) -> list[int]:
    return [special(sp, "[gMASK]"), special(sp, "sop"), special(sp, "<|user|>"), *sp.encode("\n"), *sp.encode(text),
            special(sp, "<|assistant|>")]


# --- messages and prompt ids ------------------------------------------------------------------


def test_chat_ids_with_system_tools_history_metadata_and_observation(tok, sp):
    tools = [{"name": "get_weather", "parameters": {"city": "string"}}]
    messages = [
        {"role": "system", "content": "You are helpful.", "tools": tools},
        {"role": "user", "content": "Weather in Beijing?"},
        {"role": "assistant", "metadata": "get_weather", "content": "tool_call(city='Beijing')"},
        {"role": "observation", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "It is 22 degrees."},
        {"role": "user", "content": "天气好吗？"},
    ]
    expected = [special(sp, "[gMASK]"), special(sp, "sop")]
    system_text = "You are helpful." + "\n" + json.dumps(tools, indent=4, ensure_ascii=False)
    turns = [("<|system|>", "", system_text), ("<|user|>", "", "Weather in Beijing?"),
             ("<|assistant|>", "get_weather", "tool_call(city='Beijing')"),
             ("<|observation|>", "", '{"temperature": 22}'), ("<|assistant|>", "", "It is 22 degrees."),
             ("<|user|>", "", "天气好吗？")]
    for role, metadata, content in turns:
        expected += [special(sp, role)] + sp.encode(metadata + "\n") + sp.encode(content)
    expected.append(special(sp, "<|assistant|>"))
    assert chat.chat_ids(tok, messages) == expected
    for text in (json.dumps(messages, ensure_ascii=False), json.dumps({"messages": messages})):
        assert chat.prompt_ids(tok, text) == expected


def test_role_token_text_in_a_message_stays_plain_text(tok, sp):
    text = "<|user|> [gMASK] sop <|assistant|>"
    ids = chat.prompt_ids(tok, text)
    assert ids == user_prompt(sp, text)
    assert ids.count(special(sp, "<|user|>")) == 1 and ids.count(special(sp, "<|assistant|>")) == 1


@pytest.mark.parametrize("text", ["What color is the sky?", "[1, 2]", "[1, 2, 3] sorted?", '{"a": 1}', "[not json",
                                  '"quoted"', "42", '["a", "b"]', "{oops"])
def test_text_that_is_not_a_chat_is_one_user_message(tok, sp, text):
    assert chat.chat_messages(text) == [{"role": "user", "content": text}]
    assert chat.prompt_ids(tok, text) == user_prompt(sp, text)


@pytest.mark.parametrize("text, message", [
    ("", "the prompt is empty"),
    ("  \n", "the prompt is empty"),
    ('{"messages": []}', 'the prompt: "messages" must be a non-empty list'),
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
    ("[]", "the prompt is an empty chat"),
    (" [ ] ", "the prompt is an empty chat"),
    ('{"messages": [{"role": "user", "content": "hi"}', "looks like a JSON chat but is not valid JSON"),
    ('[{"role": "user", "content": "hi"},]', "looks like a JSON chat but is not valid JSON"),
    ("[{'role': 'user', 'content': __import__('os').getcwd()}]", "not valid JSON"),  # Python: never evaluated
    ("[" * 2_000 + "]" * 2_000, "nests JSON too deeply"),
    ('[{"role": "user", "content": "hi"}, 3]', "message 1: expected a dict"),
])
def test_bad_chats_are_usage_errors(tok, text, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[")):
        chat.prompt_ids(tok, text)


def test_errors_name_what_the_text_is(tok):
    with pytest.raises(UsageError, match='^text_input: "messages" must be a non-empty list'):
        chat.prompt_ids(tok, '{"messages": []}', name="text_input")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "bot", "content": "x"}], "role must be one of system, user, assistant, observation, not 'bot'"),
    ([{"role": "user"}], "message 0: has no content"),
    ([{"role": "user", "content": ["x"]}], "content must be a string"),
    ([{"role": "user", "content": "x", "metadata": 3}], "metadata must be a string"),
    (["hello"], "message 0: expected a dict"),
    ([], "non-empty list"),
    ("hello", "non-empty list"),
])
def test_bad_messages(tok, messages, message):
    with pytest.raises(UsageError, match=message):
        chat.chat_ids(tok, messages)


# --- stop rules and word lists ----------------------------------------------------------------


def test_stop_ids_and_facts(tok, sp, fixture_dir):
    n = sp.vocab_size()
    assert chat.stop_ids(tok) == (2, n + 6, n + 8)
    facts = chat.tokenizer_facts(fixture_dir)
    assert facts == chat.tokenizer_facts(tok)
    assert facts["pad_id"] == 0 and facts["end_id"] == 2 and facts["bos_id"] == 1
    assert facts["vocab_size"] == n + 9 and facts["sp_vocab_size"] == n
    assert facts["stop_ids"] == [2, n + 6, n + 8]
    assert facts["special_ids"]["<|assistant|>"] == n + 7
    json.dumps(facts)  # goes into config files as is


def test_word_lists_in_tensorrt_llms_layout():
    # ids of every word one after another over the offset where each ends; -1 pads the offsets
    assert chat.word_list([[518], [30, 31], [7]]).tolist() == [[518, 30, 31, 7], [1, 3, 4, -1]]
    assert chat.word_list([]).tolist() == [[0], [-1]]
    stacked = chat.stack_word_lists([chat.word_list([[1]]), chat.word_list([[5, 6], [7]])])
    assert stacked.dtype == np.int32 and stacked.tolist() == [[[1, 0, 0], [1, -1, -1]], [[5, 6, 7], [2, 3, -1]]]


def test_word_lists_read_back_as_they_are_written():
    words = [[518], [520], [30, 31, 32], [9]]
    assert chat.word_sequences(chat.word_list(words), "stop_words_list") == words
    stacked = chat.stack_word_lists([chat.word_list([[1]]), chat.word_list(words)])
    assert [chat.word_sequences(row, "x") for row in stacked] == [[[1]], words]
    assert chat.word_sequences(np.array([[0], [-1]]), "x") == []


@pytest.mark.parametrize("array, message", [
    (np.zeros((3, 2), np.int32), r"must be \[2, n\]"),
    (np.array([[1, 2], [3, -1]]), "offset 3 does not follow 0 within 2 ids"),
    (np.array([[1, 2], [2, 1]]), "offset 1 does not follow 2"),
])
def test_malformed_word_lists_are_usage_errors(array, message):
    with pytest.raises(UsageError, match=message):
        chat.word_sequences(array, "stop_words_list")


def test_stop_words_hold_chatglm3s_turn_ends_and_text_in_both_spellings(tok, sp):
    user, observation = special(sp, "<|user|>"), special(sp, "<|observation|>")
    assert chat.stop_sequences(tok, []) == [[user], [observation]]
    words = chat.stop_sequences(tok, ["<|user|>", "</s>", "sky"])
    assert words[:3] == [[user], [observation], [2]]
    assert sp.encode("sky") in words and sp.encode("\nsky")[len(sp.encode("\n")):] in words
    assert chat.bad_sequences(tok, ["<|assistant|>"]) == [[special(sp, "<|assistant|>")]]


# --- reply text -------------------------------------------------------------------------------


def ids_of(sp, text: str, stop: str | None = "<|user|>") -> list[int]:
    return sp.encode(text) + ([special(sp, stop)] if stop else [])


@pytest.mark.parametrize("text, expected", [
    ("\nParis. ", "Paris."),  # process_response strips a plain reply's content
    (" \nline one\nline two \n", "line one\nline two"),
    ("no metadata line", "no metadata line"),
    ("\n", ""),
    ("get_weather\n" + CALL, "get_weather\n" + CALL),  # a tool call keeps its metadata line
    ("get_weather\n" + CALL + "\n", "get_weather\n" + CALL),
])
def test_reply_text(tok, sp, text, expected):
    assert chat.reply_text(tok, ids_of(sp, text)) == expected
    assert chat.reply_text(tok, ids_of(sp, text, stop=None)) == expected


def test_a_reply_ends_at_any_stop_id_and_skips_other_special_ids(tok, sp):
    for stop in ("</s>", "<|user|>", "<|observation|>"):
        stop_id = 2 if stop == "</s>" else special(sp, stop)
        assert chat.reply_text(tok, sp.encode("\nHi.") + [stop_id] + sp.encode("more")) == "Hi."
    assert chat.reply_text(tok, sp.encode("\nHi") + [special(sp, "sop")] + sp.encode(" there")) == "Hi there"


def stream_pieces(tok, ids: list[int], sizes: list[int]) -> tuple[list[str], list[str]]:
    """Pieces of `ids` arriving in chunks of `sizes`: from a ReplyStream, and from reply_piece."""
    stream, streamed, stateless, at = chat.ReplyStream(tok), [], [], 0
    for size in sizes:
        chunk, at = ids[at:at + size], at + size
        streamed.append(stream.add(chunk))
        stateless.append(chat.reply_piece(tok, ids[:at], len(chunk), final=at >= len(ids)))
    if not stream.finished:
        streamed.append(stream.finish())
    return streamed, stateless


def test_streamed_pieces_join_to_the_whole_reply(tok, sp, answers):
    rng = random.Random(0)
    texts = [*("\n" + a for a in answers), "\nParis. ", "\n  a  b \n c  \n", "get_weather\n" + CALL + " \n",
             "\n 天空  淼 ", "\n\n\n", ""]
    for text in texts:
        for stop in ("<|user|>", None):
            ids = ids_of(sp, text, stop)
            sizes = [rng.randint(1, 4) for _ in ids] or [1]
            streamed, stateless = stream_pieces(tok, ids, sizes)
            assert "".join(streamed) == "".join(stateless) == chat.reply_text(tok, ids), (text, streamed, stateless)
            assert not any("\ufffd" in piece for piece in streamed + stateless)


def test_trailing_whitespace_waits_for_the_text_after_it(tok, sp):
    ids = sp.encode("\nHello world.\n") + sp.encode("Bye")  # the newline is sent with the text after it
    streamed, _ = stream_pieces(tok, ids, [1] * len(ids))
    assert "".join(streamed) == sp.decode(ids).strip() and "world.\n" in sp.decode(ids)
    assert not any(piece != piece.rstrip() for piece in streamed)


# --- tool calls -------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, expected", [
    ("get_weather\n" + CALL, {"name": "get_weather", "parameters": {"city": "Beijing"}}),
    ("get_weather\n```python\ntool_call(city='Beijing', days=3, units=None)\n```",
     {"name": "get_weather", "parameters": {"city": "Beijing", "days": 3, "units": None}}),
    ('get_weather\n{"city": "Beijing", "days": [1, 2]}', {"name": "get_weather", "parameters": {"city": "Beijing",
                                                                                                  "days": [1, 2]}}),
    ("search.web\n{}", {"name": "search.web", "parameters": {}}),
])
def test_tool_calls_are_read_as_literals(reply, expected):
    assert chat.tool_call(reply) == expected


@pytest.mark.parametrize("reply", [
    "It is 22 degrees in Beijing.",
    "Line one\n{\"a\": 1}",  # a first line that is not a name
    "get_weather\nIt is sunny.",
    "get_weather\n[1, 2]",
    "get_weather\n```python\ntool_call('Beijing')\n```",  # positional: ChatGLM3 passes keywords
    "get_weather\n```python\n__import__('os').system('true')\n```",
    "get_weather\n```python\ntool_call(city=__import__('os').getcwd())\n```",  # not a literal: never run
    "get_weather\n```python\ntool_call(**{'city': 'x'})\n```",
    "get_weather",
])
def test_other_replies_are_not_tool_calls(reply):
    assert chat.tool_call(reply) is None


def test_a_generated_tool_call_reply_parses(tok, sp):
    reply = chat.reply_text(tok, sp.encode("get_weather\n") + sp.encode(CALL) + [special(sp, "<|observation|>")])
    assert chat.tool_call(reply) == {"name": "get_weather", "parameters": {"city": "Beijing"}}


# THUDM's openai_api_demo: its example tool, the tool prompt it puts first, and the assistant turn of a call.
WEATHER_TOOL = {"name": "get_current_weather", "description": "Get the current weather in a given location.",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                               "required": ["location"]}}
THUDM_TOOL_PROMPT = """Answer the following questions as best as you can. You have access to the following tools:
[
    {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string"
                }
            },
            "required": [
                "location"
            ]
        }
    }
]"""


def test_the_tool_prompt_is_thudms_sentence_then_the_tools_as_indented_json(tok, sp):
    message = chat.tools_message([WEATHER_TOOL])
    expected = [special(sp, "[gMASK]"), special(sp, "sop"), special(sp, "<|system|>")] + sp.encode("\n") + \
        sp.encode(THUDM_TOOL_PROMPT) + [special(sp, "<|user|>")] + sp.encode("\n") + sp.encode("Weather?") + \
        [special(sp, "<|assistant|>")]
    assert chat.chat_ids(tok, [message, {"role": "user", "content": "Weather?"}]) == expected
    own = chat.tools_message([WEATHER_TOOL], "Answer briefly.")
    assert chat.checked_message(own, 0)[1] == "Answer briefly." + THUDM_TOOL_PROMPT[THUDM_TOOL_PROMPT.index("\n"):]


@pytest.mark.parametrize("arguments, expected", [
    ({"location": "Beijing", "unit": "celsius"}, "```python\ntool_call(location='Beijing', unit='celsius')\n```"),
    ({"days": 3, "exact": True, "note": None, "cities": ["北京"]},
     "```python\ntool_call(days=3, exact=True, note=None, cities=['北京'])\n```"),
    ({}, "```python\ntool_call()\n```"),
    ({"not a name": 1}, '{"not a name": 1}'),
])
def test_a_tool_calls_turn_is_written_as_chatglm3_writes_it(arguments, expected):
    assert chat.tool_call_content(arguments) == expected
    assert chat.tool_call("get_current_weather\n" + expected) == {"name": "get_current_weather",
                                                                   "parameters": arguments}


@pytest.mark.parametrize("text, expected", [
    ("", True), ("get_", True), ("get_current_weather", True), ("get_current_weather\n```py", True),
    ("The", False), ("get_weather_now", False), ("get_current_weather2\n{}", False), ("1. Red\n2. Blue", False),
])
def test_a_streamed_reply_may_be_a_tool_call_while_its_first_line_may_name_a_tool(text, expected):
    assert chat.may_call_tool(text, ("get_current_weather", "search")) is expected


# --- the real ChatGLM3 tokenizer (golden values from chatglm3.md) -----------------------------

REAL = os.environ.get("TRTGLM_REAL_TOKENIZER")


@pytest.mark.skipif(not REAL, reason="set TRTGLM_REAL_TOKENIZER to a real ChatGLM3 tokenizer.model (or its folder)")
def test_real_chatglm3_chat_golden_ids():
    real = ChatGLMTokenizer(REAL)
    assert chat.stop_ids(real) == (2, 64795, 64797)
    assert chat.prompt_ids(real, "hi") == [64790, 64792, 64795, 30910, 13, 14980, 64796]
