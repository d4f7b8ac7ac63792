"""The history of the first ChatGLM3-on-Triton deployments' API: read as a literal (never run), trimmed to
the last rounds, written back as ChatGLM3's chat() records it (its turns' keys and order)."""

from __future__ import annotations

import pytest

from trtglm.chatglm.history import assistant_turn, history_text, last_rounds, parse_history
from trtglm.errors import UsageError

# A history as ChatGLM3's chat() returns it after two rounds, written as a Python literal (repr), the way
# those deployments' clients send it back.
TWO_ROUNDS = ("[{'role': 'user', 'content': 'What color is the sky?'}, "
              "{'role': 'assistant', 'metadata': '', 'content': 'The sky is blue.'}, "
              "{'role': 'user', 'content': '草是什么颜色？'}, "
              "{'role': 'assistant', 'metadata': '', 'content': '草是绿色的。'}]")
SKY = [{"role": "user", "content": "What color is the sky?"},
       {"role": "assistant", "metadata": "", "content": "The sky is blue."}]
GRASS = [{"role": "user", "content": "草是什么颜色？"},
         {"role": "assistant", "metadata": "", "content": "草是绿色的。"}]
SYSTEM = {"role": "system", "content": "You are a pirate."}


def test_a_python_literal_history_reads_and_writes_back_byte_for_byte():
    turns = parse_history([TWO_ROUNDS])
    assert turns == SKY + GRASS
    assert history_text(turns) == TWO_ROUNDS


@pytest.mark.parametrize("texts", [[], [""], ["  "], ["[]"]])
def test_no_history(texts):
    assert parse_history(texts) == []


def test_json_and_one_turn_per_string_read_too():
    assert parse_history(['[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]']) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    assert parse_history([repr(turn) for turn in SKY]) == SKY


@pytest.mark.parametrize("text, message", [
    ("__import__('os').system('touch /tmp/pwned')", "history is neither a Python literal nor JSON"),
    ("[{'role': 'user', 'content': 'hi'}", "history is neither a Python literal nor JSON"),
    ("[" * 100000 + "]" * 100000, "history is neither a Python literal nor JSON"),
    ("'just text'", "history must be a list of {'role', 'content'} turns, not str"),
    ("[('hi', 'hello')]", "message 0: expected a dict with 'role' and 'content', not tuple"),
    ("[{'role': 'robot', 'content': 'hi'}]", "message 0: role must be one of system, user, assistant, observation"),
    ("[{'role': 'user'}]", "message 0: has no content"),
])
def test_anything_else_is_one_line_error(text, message):
    with pytest.raises(UsageError) as error:
        parse_history([text])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_last_rounds_keeps_the_newest_rounds_and_the_system_turn():
    turns = [SYSTEM, *SKY, *GRASS]
    assert last_rounds(turns, 5) == turns
    assert last_rounds(turns, 2) == turns
    assert last_rounds(turns, 1) == [SYSTEM, *GRASS]
    assert last_rounds(turns, 0) == [SYSTEM]
    assert last_rounds(SKY + GRASS, 0) == []
    with pytest.raises(UsageError, match="history_len must be 0 or more, not -1"):
        last_rounds(turns, -1)


def test_a_round_with_a_tool_call_is_one_round():
    call = [{"role": "user", "content": "What is the weather in Beijing?"},
            {"role": "assistant", "metadata": "get_weather", "content": "```python\ntool_call(city='Beijing')\n```"},
            {"role": "observation", "content": '{"temperature": 22}'},
            {"role": "assistant", "metadata": "", "content": "It is 22 degrees in Beijing."}]
    assert last_rounds([*SKY, *call], 1) == call


def test_assistant_turn_as_chatglm3_records_it():
    assert assistant_turn("Hello") == {"role": "assistant", "metadata": "", "content": "Hello"}
    assert assistant_turn("get_weather\n```python\ntool_call(city='Beijing')\n```") == {
        "role": "assistant", "metadata": "get_weather", "content": "```python\ntool_call(city='Beijing')\n```"}
