"""ChatGLM3 prompt ids from a request's text: one user message, or a chat given as JSON.

A chat is `{"messages": [...]}` or a JSON list of `{"role", "content"}` objects (roles system,
user, assistant, observation; a system message may carry "tools"). Any other text, JSON that
is not shaped like a chat included, is one user message. JSON is read with `json.loads`
only. Text that starts like a chat but does not parse is an error rather than a prompt.
"""

from __future__ import annotations

import json
import re

from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

_CHAT_START = re.compile(r'\s*(\{.*"messages"|\[\s*\{)', re.S)


def prompt_ids(tokenizer: ChatGLMTokenizer, text: str) -> list[int]:
    """`[gMASK] sop <|role|> ... <|assistant|>` ids for `text` (UsageError for empty or malformed chats)."""
    if not text.strip():
        raise UsageError("text_input is empty")
    messages = chat_messages(text)
    if messages is None:
        messages = [{"role": "user", "content": text}]
    return tokenizer.build_chat_input(messages)


def chat_messages(text: str) -> list | None:
    """The messages of a JSON chat, or None when `text` is a plain message."""
    if text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        data = json.loads(text)
    except RecursionError:
        raise UsageError("text_input nests JSON too deeply to be a chat") from None
    except json.JSONDecodeError as e:
        if _CHAT_START.match(text):
            raise UsageError(f"text_input looks like a JSON chat but is not valid JSON: {e.msg} "
                             f"(line {e.lineno}, column {e.colno})") from None
        return None
    if isinstance(data, dict) and "messages" in data:
        if not isinstance(data["messages"], list) or not data["messages"]:
            raise UsageError('text_input: "messages" must be a non-empty list of {"role", "content"} objects')
        return data["messages"]
    if isinstance(data, list) and data and all(isinstance(m, dict) for m in data):
        return data
    return None
