"""Prompt files, as `trtglm verify --prompts`, FP8 calibration and `bench fp8` read them: a text file of one user
prompt per line, or JSONL of `{"messages": [...]}` conversations (one ending with the assistant's answer is prompted
with what comes before it). Blank lines are skipped; a file with no prompt is an error."""

from __future__ import annotations

import json
from pathlib import Path

from trtglm.chatglm.chat import PROMPT_IDS
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.chatglm.variants import DEFAULT_VERSION
from trtglm.errors import ModelFileError, UsageError


def read_prompt_chats(path: str | Path, name: str) -> list[list[dict]]:
    """Each prompt of the file as chat messages; `name` says which flag or key gave the file (for messages)."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{name} {path}: cannot read ({e})") from None
    if not lines:
        raise UsageError(f"{name} {path}: no prompts")
    if path.suffix != ".jsonl":
        return [[{"role": "user", "content": line}] for line in lines]
    chats = []
    for number, line in enumerate(lines, 1):
        try:
            messages = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{name} {path}:{number}: expected a JSON object with \"messages\"") from None
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages = messages[:-1]  # a conversation with its answer: prompt with what comes before
        chats.append(messages)
    return chats


def read_prompt_ids(path: str | Path, tokenizer_dir: str | Path, name: str,
                    version: str = DEFAULT_VERSION) -> list[list[int]]:
    """Each prompt of the file as prompt ids in `version`'s chat format, encoded by the tokenizer of
    `tokenizer_dir`."""
    chats = read_prompt_chats(path, name)
    tokenizer = load_tokenizer(tokenizer_dir, f"to encode the prompts of {name} with")
    return [PROMPT_IDS[version](tokenizer, messages) for messages in chats]


def load_tokenizer(folder: str | Path, why: str) -> ChatGLMTokenizer:
    if not (Path(folder) / "tokenizer.model").is_file():
        raise ModelFileError(f"{folder}: no tokenizer.model {why}")
    return ChatGLMTokenizer(folder)
