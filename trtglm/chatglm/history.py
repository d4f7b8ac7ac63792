"""A conversation kept as a history: the turns of the history API (backend/history_chat.py).

The first ChatGLM3-on-Triton deployments kept a conversation as ChatGLM3's `chat()`
returns it: a list of turns `{'role', 'content'}` (assistant turns `{'role', 'metadata', 'content'}`),
written as a Python literal that the client sends back with its next prompt. `parse_history` reads
it with `ast.literal_eval` (or `json.loads`), never running anything: the whole list in one
string, or one turn per string; a blank string or none is no history. `last_rounds` keeps the last
N rounds (a round starts at a user turn; system turns before the first round are settings, not
rounds, and stay); `history_text` writes a history back as that literal.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence

from trtglm.chatglm.chat import checked_message, tool_call
from trtglm.errors import UsageError


def parse_history(texts: Sequence[str]) -> list[dict]:
    """The turns a request's history strings hold (see the module docstring); UsageError for anything else."""
    texts = [text for text in texts if text.strip()]
    if len(texts) == 1:
        turns = _literal(texts[0])
        turns = [turns] if isinstance(turns, dict) else turns
    else:
        turns = [_literal(text) for text in texts]
    if not isinstance(turns, list):
        raise UsageError(f"history must be a list of {{'role', 'content'}} turns, not {type(turns).__name__}")
    for position, turn in enumerate(turns):
        checked_message(turn, position)
    return turns


def _literal(text: str) -> object:
    """A Python literal or JSON value, read without running anything."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise UsageError("history is neither a Python literal nor JSON: send the history the previous reply "
                         "gave, or an empty string") from None


def last_rounds(turns: Sequence[dict], rounds: int) -> list[dict]:
    """`turns` with only the last `rounds` rounds (0: none), system turns before the first round kept."""
    if rounds < 0:
        raise UsageError(f"history_len must be 0 or more, not {rounds}")
    starts = [i for i, turn in enumerate(turns) if turn["role"] == "user"]
    if len(starts) <= rounds:
        return list(turns)
    head = list(turns[:starts[0]])
    return head + list(turns[starts[-rounds]:]) if rounds else head


def assistant_turn(reply: str) -> dict:
    """The history turn of a reply, as ChatGLM3's chat() records it: a tool call's name is its metadata."""
    call = tool_call(reply)
    if call is None:
        return {"role": "assistant", "metadata": "", "content": reply}
    name, _, content = reply.strip().partition("\n")
    return {"role": "assistant", "metadata": name.strip(), "content": content}


def history_text(turns: Sequence[dict]) -> str:
    """A history as the Python literal clients send back."""
    return repr(list(turns))


