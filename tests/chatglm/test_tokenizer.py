"""ChatGLM3 tokenizer: special ids, encoding, decoding and streaming (the chat format: test_chat.py).

Expected ids are computed here from raw `sentencepiece` calls and ChatGLM3's documented
layout (nine special tokens after the SentencePiece vocabulary, `[gMASK] sop` prefix), never
from the tokenizer under test. The golden ids of the real ChatGLM3 tokenizer run when
TRTGLM_REAL_TOKENIZER names its `tokenizer.model`.
"""

from __future__ import annotations

import os
import random

import pytest
from support.tokenizer import SPECIALS, answers, sp, special, tok  # noqa: F401 (fixtures)

from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import ModelFileError, UsageError

def test_special_ids_follow_the_sentencepiece_vocabulary(tok, sp):
    n = sp.vocab_size()
    assert tok.special_ids == {name: n + i for i, name in enumerate(SPECIALS)}
    assert tok.vocab_size == n + 9
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert [sp.id_to_piece(i) for i in (0, 1, 2)] == ["<unk>", "<s>", "</s>"]
    assert tok.token_id("<|user|>") == n + 6
    assert tok.token_id("</s>") == 2 and tok.token_id("<unk>") == 0
    assert tok.token_id("▁") == sp.piece_to_id("▁")


def test_file_or_folder_path(fixture_dir):
    assert ChatGLMTokenizer(fixture_dir / "tokenizer.model").vocab_size == ChatGLMTokenizer(fixture_dir).vocab_size


def test_encode_adds_the_gmask_sop_prefix(tok, sp):
    text = "Hello, I am  two spaces 和中文"
    assert tok.encode(text) == [special(sp, "[gMASK]"), special(sp, "sop")] + sp.encode(text)
    assert tok.encode(text, add_prefix=False) == sp.encode(text)


def test_newline_encodes_like_chatglm3(sp):
    assert sp.encode("\n", out_type=str) == ["▁", "<0x0A>"]


def test_fixture_has_byte_fallback_chinese(sp, answers):
    """Some answer characters are outside the vocabulary: they stream as several byte pieces."""
    chinese = {c for a in answers for c in a if "\u4e00" <= c <= "\u9fff"}
    byte_chars = {c for c in chinese if sum(sp.is_byte(i) for i in sp.encode(c)) == len(c.encode("utf-8"))}
    assert len(byte_chars) >= 3
    assert chinese - byte_chars, "most Chinese characters should still be single pieces"
    for char in byte_chars:
        assert sp.encode(char, out_type=str)[1:] == [f"<0x{b:02X}>" for b in char.encode("utf-8")]


def test_role_token_text_stays_plain_text(tok, sp):
    text = "<|user|> [gMASK] sop <|assistant|>"
    assert tok.encode(text, add_prefix=False) == sp.encode(text)
    assert all(i < sp.vocab_size() for i in tok.encode(text, add_prefix=False))


@pytest.mark.parametrize("text", ["Hello  world, two  spaces and a\nnewline", "天空是蓝色的。", "三个水是淼字。 mixed 中文 text"])
def test_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_keeps_special_text_when_asked(tok, sp):
    ids = [special(sp, name) for name in ("[gMASK]", "sop", "<|user|>")] + sp.encode("\n") + sp.encode("hi") + \
        [special(sp, "<|assistant|>")]
    expected = "[gMASK]sop<|user|>" + sp.decode(sp.encode("\n") + sp.encode("hi")) + "<|assistant|>"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert tok.decode(ids) == sp.decode(sp.encode("\n") + sp.encode("hi"))


def reply_ids(sp, answer: str) -> list[int]:
    """What the model generates for an answer: blank metadata line, answer, `<|user|>`."""
    return sp.encode("\n") + sp.encode(answer) + [special(sp, "<|user|>")]


def stream(tok, ids: list[int], chunk: int = 1) -> list[str]:
    detok = tok.incremental()
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [detok.flush()]


def test_streaming_every_answer_one_id_at_a_time(tok, sp, answers):
    for answer in answers:
        ids = reply_ids(sp, answer)
        pieces = stream(tok, ids)
        assert not any("\ufffd" in piece for piece in pieces), (answer, pieces)
        assert "".join(pieces) == tok.decode(ids)


def test_streaming_holds_back_partial_characters(tok, sp):
    ids = sp.encode("淼")  # "▁" then three byte pieces
    detok = tok.incremental()
    assert [detok.add(i) for i in ids] == ["", "", "", "淼"]


def test_streaming_random_text(tok):
    rng = random.Random(0)
    alphabet = list("abc XYZ,.\n") + list("天空是蓝色的淼犇鑫焱垚") + ["  "]
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text) + [tok.token_id("<|user|>")]
        for chunk in (1, 3):
            pieces = stream(tok, ids, chunk)
            assert "".join(pieces) == tok.decode(ids) == text
            assert not any("\ufffd" in piece for piece in pieces)


def test_streaming_random_ids_matches_decode(tok):
    """Arbitrary ids (stray bytes, special ids, control pieces): same text as decoding at once."""
    rng = random.Random(1)
    byte_ids = [i for i in range(tok.sp_vocab_size) if tok.sp.is_byte(i)]
    for _ in range(300):
        ids = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 25))]
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), ids
        if not any(tok.is_special(i) for i in ids):  # a special id ends a run: its text is flushed
            assert not any(piece.endswith("\ufffd") for piece in pieces[:-1]), ids


def test_bad_ids_and_names(tok):
    with pytest.raises(UsageError, match="outside the tokenizer's vocabulary"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(UsageError, match="outside"):
        tok.incremental().add([-1])
    with pytest.raises(UsageError, match="unknown token"):
        tok.token_id("<|nobody|>")
    with pytest.raises(UsageError):
        tok.encode(None)


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        ChatGLMTokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ModelFileError, match="not a SentencePiece model"):
        ChatGLMTokenizer(tmp_path)


# --- the real ChatGLM3 tokenizer (golden values from chatglm3.md) -----------------------------

REAL = os.environ.get("TRTGLM_REAL_TOKENIZER")


@pytest.mark.skipif(not REAL, reason="set TRTGLM_REAL_TOKENIZER to a real ChatGLM3 tokenizer.model (or its folder)")
def test_real_chatglm3_golden_ids():
    real = ChatGLMTokenizer(REAL)
    assert real.sp_vocab_size == 64789 and real.vocab_size == 64798
    assert real.special_ids == {name: 64789 + i for i, name in enumerate(SPECIALS)}
    assert real.special_ids["[gMASK]"] == 64790 and real.special_ids["sop"] == 64792
    assert (real.pad_id, real.bos_id, real.eos_id) == (0, 1, 2)
    assert real.encode("\n", add_prefix=False) == [30910, 13]
    assert real.encode("<|user|>", add_prefix=False) != [64795]
