"""ChatGLM3 tokenizer: special ids, prompt format, decoding and streaming.

Expected ids are computed here from raw `sentencepiece` calls and ChatGLM3's documented
layout (nine special tokens after the SentencePiece vocabulary, `[gMASK] sop` prefix,
`<|role|>` + encode(metadata + "\\n") + encode(content) per message), never from the
tokenizer under test. The golden ids of the real ChatGLM3 tokenizer run when
TRTGLM_REAL_TOKENIZER names its `tokenizer.model`.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import sentencepiece

from trtglm.chatglm.tokenizer import ChatGLMTokenizer, parse_reply, split_reply, tokenizer_facts
from trtglm.errors import ModelFileError, UsageError

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


def test_special_ids_follow_the_sentencepiece_vocabulary(tok, sp):
    n = sp.vocab_size()
    assert tok.special_ids == {name: n + i for i, name in enumerate(SPECIALS)}
    assert tok.vocab_size == n + 9
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert [sp.id_to_piece(i) for i in (0, 1, 2)] == ["<unk>", "<s>", "</s>"]
    assert tok.stop_ids == (2, n + 6, n + 8)
    assert tok.token_id("<|user|>") == n + 6
    assert tok.token_id("</s>") == 2 and tok.token_id("<unk>") == 0
    assert tok.token_id("▁") == sp.piece_to_id("▁")


def test_facts_for_config_files(tok, sp, fixture_dir):
    n = sp.vocab_size()
    facts = tokenizer_facts(fixture_dir)
    assert facts == tok.facts()
    assert facts["pad_id"] == 0 and facts["end_id"] == 2 and facts["bos_id"] == 1
    assert facts["vocab_size"] == n + 9 and facts["sp_vocab_size"] == n
    assert facts["stop_ids"] == [2, n + 6, n + 8]
    assert facts["special_ids"]["<|assistant|>"] == n + 7
    json.dumps(facts)  # goes into config files as is


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


def test_chat_input_with_system_history_and_metadata(tok, sp):
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
    assert tok.build_chat_input(messages) == expected


def test_chat_input_query_history_form(tok):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    assert tok.build_chat_input("Bye", history) == tok.build_chat_input(
        [*history, {"role": "user", "content": "Bye"}])


def test_role_token_text_stays_plain_text(tok, sp):
    text = "<|user|> [gMASK] sop <|assistant|>"
    assert tok.encode(text, add_prefix=False) == sp.encode(text)
    assert all(i < sp.vocab_size() for i in tok.encode(text, add_prefix=False))
    ids = tok.build_chat_input([{"role": "user", "content": text}])
    assert ids.count(special(sp, "<|user|>")) == 1 and ids.count(special(sp, "<|assistant|>")) == 1


@pytest.mark.parametrize("text", ["Hello  world, two  spaces and a\nnewline", "天空是蓝色的。", "三个水是淼字。 mixed 中文 text"])
def test_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_keeps_special_text_when_asked(tok, sp):
    ids = tok.build_chat_input([{"role": "user", "content": "hi"}])
    expected = "[gMASK]sop<|user|>" + sp.decode(sp.encode("\n") + sp.encode("hi")) + "<|assistant|>"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert tok.decode(ids) == sp.decode(sp.encode("\n") + sp.encode("hi"))


def test_parse_reply():
    assert parse_reply("\n Hello world.") == "Hello world."
    assert parse_reply(" \nline one\nline two \n") == "line one\nline two"
    assert parse_reply("no metadata line") == "no metadata line"
    call = "get_weather\n```python\ntool_call(city='Beijing')\n```"
    assert split_reply(call) == ("get_weather", "```python\ntool_call(city='Beijing')\n```")
    assert parse_reply(call) == "```python\ntool_call(city='Beijing')\n```"
    assert parse_reply("<|assistant|>\nfirst<|assistant|>\n second") == "second"


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
        assert parse_reply("".join(pieces)) == answer


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


@pytest.mark.parametrize("messages, message", [
    ([{"role": "bot", "content": "x"}], "role must be one of"),
    ([{"role": "user"}], "has no content"),
    ([{"role": "user", "content": ["x"]}], "content must be a string"),
    ([{"role": "user", "content": "x", "metadata": 3}], "metadata must be a string"),
    (["hello"], "expected a dict"),
    ([], "non-empty list"),
])
def test_bad_chat_messages(tok, messages, message):
    with pytest.raises(UsageError, match=message):
        tok.build_chat_input(messages)


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
    assert real.stop_ids == (2, 64795, 64797)
    assert (real.pad_id, real.bos_id, real.eos_id) == (0, 1, 2)
    assert real.encode("\n", add_prefix=False) == [30910, 13]
    assert real.build_chat_input([{"role": "user", "content": "hi"}]) == [64790, 64792, 64795, 30910, 13, 14980, 64796]
    assert real.encode("<|user|>", add_prefix=False) != [64795]
