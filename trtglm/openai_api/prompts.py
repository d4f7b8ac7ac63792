"""The API's requests as ChatGLM3 chats (chat.py's JSON chat, which the served preprocessing reads), and their
prompts counted as the served preprocessing counts them.

`chatglm_messages`: `tools` become the system message that offers them (the request's first system message's
text, or THUDM's sentence, then the functions as ChatGLM3 lists them: name, description, parameters), an
assistant message's `tool_calls` become turns whose metadata is the tool's name and whose content is the call as
ChatGLM3 writes it, and `tool` messages become `observation` turns. `developer` is a system message. A
completion's prompt is one user turn (the served models answer chats). A prompt's tokens are counted in the
engine's own prompt format (ChatGLM2's for a ChatGLM2 engine) against its limits (contract.Limits); an answer may
take what max_seq_len leaves after the prompt.
"""

from __future__ import annotations

import json

from trtglm.backend.contract import Limits
from trtglm.chatglm.chat import PROMPT_IDS, chat_text, tool_call_content, tools_message
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import PromptTooLongError, UsageError
from trtglm.openai_api.errors import ApiError
from trtglm.openai_api.protocol import ChatRequest, ToolCall


def chatglm_messages(request: ChatRequest) -> list[dict]:
    """The request's messages as ChatGLM3's chat (see the module docstring)."""
    tools = [function.model_dump(exclude_none=True) for function in request.offered_tools()]
    messages: list[dict] = []
    system_pending = bool(tools)  # the first system message's text goes into the tool prompt
    for position, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        if role == "system" and system_pending:
            messages.insert(0, tools_message(tools, message.text()))
            system_pending = False
        elif role == "assistant" and message.tool_calls:
            messages += [_tool_call_turn(call, position) for call in message.tool_calls]
        else:
            messages.append({"role": "observation" if role == "tool" else role, "content": message.text()})
    if system_pending:
        messages.insert(0, tools_message(tools))
    return messages


def _tool_call_turn(call: ToolCall, position: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"messages[{position}]: a tool call's arguments must be a JSON object",
                       f"messages.[{position}].tool_calls")
    return {"role": "assistant", "metadata": call.function.name, "content": tool_call_content(arguments)}


def completion_messages(prompt: str) -> list[dict]:
    """A completion's prompt as ChatGLM3's chat: one user turn (the served models answer chats)."""
    return [{"role": "user", "content": prompt}]


def prompt_length(limits: Limits, tokenizer: ChatGLMTokenizer, messages: list[dict], param: str) -> int:
    """The prompt's token count, as the served preprocessing will count it; 400 when it does not fit."""
    try:
        limits.check_prompt_bytes(len(chat_text(messages).encode()), tokenizer.longest_piece_bytes)
        count = len(PROMPT_IDS[limits.chatglm_version](tokenizer, messages))
        limits.check_prompt_tokens(count)
    except PromptTooLongError as e:
        raise ApiError(400, str(e), param, "context_length_exceeded") from None
    except UsageError as e:
        raise ApiError(400, str(e), param) from None
    return count


def token_limit(limits: Limits, requested: int | None, prompt_tokens: int) -> int:
    """The most tokens an answer may take: `requested` (max_tokens), or what max_seq_len leaves after the prompt."""
    room = limits.max_seq_len - prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt ({prompt_tokens} tokens) leaves no room for an answer within the "
                            f"engine's max_seq_len ({limits.max_seq_len})", "messages", "context_length_exceeded")
    return min(requested, room) if requested is not None else room
