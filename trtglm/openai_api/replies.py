"""One choice's reply as Triton's pieces arrive: stop strings cut it (streamed text that may begin one is held back
until it is known); with tools offered, a reply whose first line is a tool's name is held back and, when its rest
reads as the call's arguments (chat.tool_call), answered as `tool_calls` (finish_reason "tool_calls");
finish_reason is the engine's (stop or length) when it reports one, else "length" when the reply's generated tokens
reached its limit (counted from the engine's count, when it reports one). Log probabilities pair each
generated token's value with that token's text as ChatGLM3 writes the reply (chat.reply_tokens).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from trtglm.chatglm.chat import may_call_tool, reply_tokens, tool_call
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.openai_api.triton import Piece


@dataclass
class ChoiceText:
    """One choice's reply as pieces arrive: stop strings cut it, text that may begin one (or, with tools,
    a tool call) is held back; `finish` gives the rest and the tool call, if the reply is one."""

    stops: tuple[str, ...]
    tool_names: tuple[str, ...]
    limit: int
    text: str = ""
    sent: int = 0
    tokens: int = 0  # generated so far
    log_probs: list[float] = field(default_factory=list)
    stopped: bool = False
    engine_reason: str = ""  # why the engine ended the reply, when it says

    def add(self, piece: Piece) -> str:
        """Text that can be sent now."""
        if self.stopped:
            return ""
        self.tokens = piece.tokens_so_far if piece.tokens_so_far is not None else self.tokens + piece.tokens
        self.engine_reason = piece.finish_reason or self.engine_reason
        self.log_probs += piece.log_probs
        self.text += piece.text
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
        if self.tool_names and may_call_tool(self.text, self.tool_names):
            return ""
        ready = len(self.text) if self.stopped else len(self.text) - _held_back(self.text, self.stops)
        out, self.sent = self.text[self.sent:ready], max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, dict | None]:
        """(text not sent yet, the tool call {"name", "parameters"} or None)."""
        call = tool_call(self.text) if self.tool_names and not self.stopped else None
        if call is not None and call["name"] in self.tool_names:
            return "", call
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, None

    def finish_reason(self, call: dict | None) -> str:
        if call is not None:
            return "tool_calls"
        if self.stopped or self.engine_reason:
            return "stop" if self.stopped else self.engine_reason
        return "length" if self.tokens >= self.limit else "stop"


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def tool_calls(call: dict, streamed: bool) -> list[dict]:
    """A tool call {"name", "parameters"} as OpenAI's `tool_calls` (a streamed delta's entries carry an index)."""
    entry = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["parameters"], ensure_ascii=False)}}
    return [{"index": 0, **entry} if streamed else entry]


def token_log_probs(tokenizer: ChatGLMTokenizer, text: str, call: dict | None,
                    values: list[float]) -> list[tuple[str, float]]:
    """(token text, log prob) per generated token: the reply's tokens as ChatGLM3 writes its turn, paired with the
    engine's values in order ("" past them)."""
    tokens = reply_tokens(tokenizer, text, call is not None)
    return [(tokens[i] if i < len(tokens) else "", value) for i, value in enumerate(values)]
