"""The fixture tokenizer's fixtures (`tok`, `sp`, `answers`), ChatGLM3's special ids as documented (nine special
tokens after the SentencePiece vocabulary, in this order) and the ids of a fixture conversation's reply."""

from __future__ import annotations

import json

import pytest
import sentencepiece

from trtglm.chatglm.tokenizer import ChatGLMTokenizer

# ChatGLM3's special tokens in the order they follow the SentencePiece vocabulary.
SPECIALS = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
OFFSET = {name: i for i, name in enumerate(SPECIALS)}


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module")
def sp(fixture_dir) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(fixture_dir / "tokenizer.model"))


@pytest.fixture(scope="module")
def answers(fixture_dir) -> list[str]:
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["answer"] for line in lines]


def special(sp, name: str) -> int:
    return sp.vocab_size() + OFFSET[name]


def reply_ids(sp, conversation: dict) -> list[int]:
    """The ids the fixture generates for a conversation of conversations.jsonl, in ChatGLM3's reply format:
    encode(metadata + "\\n") + encode(content), then the stop token. A plain answer's metadata line is blank and
    `<|user|>` ends it; a tool call's metadata is the tool's name and `<|observation|>` ends it."""
    call = conversation.get("tool_call")
    if call:
        return sp.encode(call["name"] + "\n") + sp.encode(call["content"]) + [special(sp, "<|observation|>")]
    return sp.encode("\n") + sp.encode(conversation["answer"]) + [special(sp, "<|user|>")]
