"""The fast tokenizer trtglm writes for ChatGLM3 (trtglm/chatglm/fast_tokenizer.py) loads with transformers'
AutoTokenizer without trust_remote_code and gives the ids of trtglm's tokenizer (itself checked against
ChatGLM3's in test_tokenizer.py) on every fixture text, Chinese, bytes outside the vocabulary, spaces,
newlines and special-token text; its end and pad tokens are `</s>` and `<unk>`, as NVIDIA's clients look
them up."""

from __future__ import annotations

import json

import pytest

from trtglm.chatglm.fast_tokenizer import write_fast_tokenizer
from trtglm.chatglm.tokenizer import ChatGLMTokenizer

EXTRA_TEXTS = ["", "Hello", " Hello", "a  b", "x\ny\n\n", "  lead", "trail  ", "tab\there", "天空是蓝色的 淼犇鑫焱垚",
               "😀 emoji and ünïcödé", "<|user|> hi [gMASK] sop", "What is <|assistant|>?", "1234567890 +-*/"]


@pytest.fixture(scope="module")
def tokenizers(fixture_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = write_fast_tokenizer(fixture_dir, tmp_path_factory.mktemp("fast-tokenizer"))
    return ChatGLMTokenizer(fixture_dir), AutoTokenizer.from_pretrained(str(folder))


def fixture_texts(fixture_dir) -> list[str]:
    conversations = [json.loads(line) for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]
    return [c["answer"] for c in conversations] + [m["content"] for c in conversations for m in c["messages"]]


def test_the_ids_are_trtglms_on_every_text(tokenizers, fixture_dir):
    ours, fast = tokenizers
    texts = fixture_texts(fixture_dir) + EXTRA_TEXTS
    assert len(texts) > 100
    assert [fast.encode(t) for t in texts] == [ours.encode(t) for t in texts]
    assert [fast.encode(t, add_special_tokens=False) for t in texts] == [ours.encode(t, add_prefix=False)
                                                                         for t in texts]


def test_decoding_gives_the_text_back(tokenizers, fixture_dir):
    ours, fast = tokenizers
    for text in fixture_texts(fixture_dir) + [t for t in EXTRA_TEXTS if "<|" not in t]:
        ids = ours.encode(text, add_prefix=False)
        assert fast.decode(ids) == ours.decode(ids) == text


def test_the_end_and_pad_tokens_are_those_nvidias_clients_look_up(tokenizers):
    ours, fast = tokenizers
    assert fast.encode(fast.eos_token, add_special_tokens=False) == [ours.eos_id]
    assert fast.encode(fast.pad_token, add_special_tokens=False) == [ours.pad_id]
    assert len(fast) == ours.vocab_size
