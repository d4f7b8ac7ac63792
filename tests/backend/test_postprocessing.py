"""Reply text from generated ids: whole (ensemble postprocessing) and streamed (the BLS model),
checked against the fixture's exact answers in ChatGLM3's reply format ("\\n" metadata line,
answer, then a stop token), Chinese byte-fallback characters and SentencePiece spaces included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtglm.backend.bls import ReplyTexts, engine_inputs
from trtglm.backend.contract import Limits
from trtglm.backend.postprocessing import flat_texts, postprocess, reply_prefixes
from trtglm.backend.preprocessing import preprocess
from trtglm.chatglm.chat import ReplyStream, tool_call
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

JUNK = "What is my name?"  # what a model that misses the stop token would go on to say


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module")
def answers(fixture_dir) -> list[str]:
    return [json.loads(line)["answer"] for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]


def generated(tok: ChatGLMTokenizer, answer: str, stop: str = "<|user|>") -> list[int]:
    """What ChatGLM3 generates for `answer` (chatglm3.md): encode("\\n" metadata line) + encode(answer), then the
    stop token, then whatever a server that ignored it would add."""
    return tok.sp.encode("\n") + tok.sp.encode(answer) + [tok.token_id(stop)] + tok.sp.encode(JUNK)


def batch(*sequences: list[int], pad: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """TOKENS_BATCH [batch, 1 beam, width] padded with junk beyond each SEQUENCE_LENGTH."""
    width = max(map(len, sequences)) + 3
    tokens = np.full((len(sequences), 1, width), pad, dtype=np.int32)
    for row, ids in enumerate(sequences):
        tokens[row, 0, :len(ids)] = ids
    return tokens, np.array([[len(ids)] for ids in sequences], dtype=np.int32)


def test_fixture_answers_exercise_what_token_by_token_decoding_breaks(tok, answers):
    """The data can fail a wrong decoder: decoding ids one at a time loses spaces and splits characters."""
    naive = {a: "".join(tok.decode([i]) for i in tok.sp.encode(a)) for a in answers}
    assert any(" " in a and naive[a].replace("\ufffd", "") != a and "\ufffd" not in naive[a] for a in answers)
    assert any("\ufffd" in naive[a] for a in answers)


def test_whole_sequences_decode_to_the_answers(tok, answers):
    for stop in ("<|user|>", "<|observation|>", "</s>"):
        sequences = [generated(tok, a, stop) for a in answers]
        assert postprocess(tok, *batch(*sequences)) == [[a] for a in answers]


def test_sequence_without_a_stop_token_is_decoded_to_its_length(tok):
    ids = tok.sp.encode("\n") + tok.sp.encode("三个水是淼字。")
    assert postprocess(tok, *batch(ids)) == [["三个水是淼字。"]]
    assert postprocess(tok, *batch(ids[:-1])) == [["三个水是淼字"]]


def test_beams_and_batch_rows(tok):
    a, b, c = (generated(tok, t) for t in ("Grass is green.", "天空是蓝色的。", "1. Red\n2. Blue"))
    tokens = np.zeros((2, 2, max(map(len, (a, b, c)))), dtype=np.int32)
    tokens[0, 0, :len(a)], tokens[0, 1, :len(b)], tokens[1, 0, :len(c)] = a, b, c
    lengths = np.array([[len(a), len(b)], [len(c), 0]], dtype=np.int32)
    assert postprocess(tok, tokens, lengths) == [["Grass is green.", "天空是蓝色的。"], ["1. Red\n2. Blue", ""]]


def test_tool_call_keeps_its_metadata_line(tok):
    ids = tok.sp.encode("get_weather\n") + tok.sp.encode("```python\ntool_call(city='Beijing')\n```")
    (reply,), = postprocess(tok, *batch(ids + [tok.special_ids["<|observation|>"]]))
    assert reply == tok.decode(ids)
    assert tool_call(reply) == {"name": "get_weather", "parameters": {"city": "Beijing"}}


def test_bad_shapes_are_usage_errors(tok):
    with pytest.raises(UsageError, match="TOKENS_BATCH"):
        postprocess(tok, np.zeros((1, 4), np.int32), np.zeros((1, 1), np.int32))


# --- streamed (BLS) ------------------------------------------------------------------------------


def test_streamed_pieces_join_to_the_whole_reply(tok, answers):
    for answer in answers:
        stream = ReplyStream(tok)
        pieces = [stream.add([i]) for i in generated(tok, answer)] + [stream.finish()]
        assert "".join(pieces) == answer
        assert not any("\ufffd" in piece for piece in pieces)
        assert stream.finished


def test_streamed_pieces_in_uneven_chunks(tok, answers):
    for answer in answers:
        ids, stream, pieces, at = generated(tok, answer), ReplyStream(tok), [], 0
        for size in [2, 1, 3] * len(ids):
            pieces.append(stream.add(ids[at:at + size]))
            at += size
        assert "".join(pieces) + stream.finish() == answer


def test_bls_reply_pieces_and_accumulated_text(tok, answers):
    for answer in answers:
        ids = generated(tok, answer)
        deltas, accumulated = ReplyTexts(tok, accumulate=False), ReplyTexts(tok, accumulate=True)
        pieces, texts = [], []
        for i in ids:
            tokens, lengths = batch([i])
            pieces.append(deltas.add(tokens, lengths)[0][0])
            texts.append(accumulated.add(tokens, lengths)[0][0])
        assert "".join(pieces) + deltas.ends(streamed=True)[0, 0] == answer
        shown = [t for t in texts if t]
        assert shown[-1] == answer and all(answer.startswith(t) for t in shown)


def test_bls_reply_collects_a_whole_reply_from_parts(tok):
    answer = "森林 means forest, a place with many trees."
    ids, reply = generated(tok, answer), ReplyTexts(tok, accumulate=False)
    for part in (ids[:3], ids[3:]):
        reply.collect(*batch(part))
    assert reply.whole() == [[answer]]


def test_bls_engine_inputs_use_tensorrt_llm_names(tok):
    client = {"text_input": np.array([[b"hi"]], dtype=np.object_), "max_tokens": np.array([[5]], np.int32),
              "top_k": np.array([1], np.int32), "temperature": np.array([[0.5]], np.float32),
              "stream": np.array([[True]]), "beam_width": None}
    prepared = preprocess(tok, Limits(256, 512, 1024), {"QUERY": client["text_input"],
                                                        "REQUEST_OUTPUT_LEN": client["max_tokens"]})
    arrays = engine_inputs(prepared, client)
    assert set(arrays) == {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
                           "bad_words_list", "runtime_top_k", "temperature", "streaming"}  # no empty embedding_bias
    assert arrays["runtime_top_k"].shape == (1, 1) and arrays["input_ids"].tolist() == prepared["INPUT_ID"].tolist()


# --- streamed through the ensemble (every id so far with each response) --------------------------


def ensemble_pieces(tok: ChatGLMTokenizer, ids: list[int], sizes: list[int], end_without_ids: bool) -> list[str]:
    """What postprocessing gives for each response of a stream of `ids` split into `sizes`, as trtglm's
    runtime sends it (new ids in TOKENS_BATCH, all so far in GENERATED_IDS, IS_FINAL on the last)."""
    pieces, at = [], 0
    cuts = [size for size in sizes if size] + ([0] if end_without_ids else [])
    for number, size in enumerate(cuts):
        new = ids[at:at + size]
        at += size
        so_far = np.array(ids[:at], dtype=np.int32).reshape(1, 1, -1)
        final = np.array([[number == len(cuts) - 1]])
        pieces.append(postprocess(tok, *batch(new) if new else (np.zeros((1, 1, 0), np.int32), np.array([[0]])),
                                  so_far, final)[0][0])
    return pieces


@pytest.mark.parametrize("sizes", [[1], [2, 1, 3], [5]])
def test_ensemble_stream_pieces_join_to_the_whole_reply(tok, answers, sizes):
    for answer in answers:
        ids = generated(tok, answer)
        cut = ids[:ids.index(tok.token_id("<|user|>")) + 1]  # the engine stops after the stop word
        split = (sizes * len(cut))[:len(cut)]
        while sum(split) > len(cut):
            split[-1] -= sum(split) - len(cut)
        for end_without_ids in (False, True):
            pieces = ensemble_pieces(tok, cut, split, end_without_ids)
            assert "".join(pieces) == answer
            assert not any("\ufffd" in piece for piece in pieces)


def test_ensemble_stream_pieces_equal_whole_decoding_for_any_ids(tok):
    """Random ids (byte pieces cut mid-character, specials, stop ids, a reply cut off mid-character):
    the pieces join to exactly what the whole sequence decodes to."""
    generator = np.random.default_rng(3)
    for _ in range(200):
        length = int(generator.integers(1, 25))
        ids = generator.integers(0, tok.vocab_size, size=length).tolist()
        expected = postprocess(tok, *batch(ids))[0][0]
        sizes = generator.integers(1, 4, size=length).tolist()
        assert "".join(ensemble_pieces(tok, ids, sizes, bool(generator.integers(0, 2)))) == expected


def test_tool_call_streams_with_its_metadata_line(tok):
    ids = tok.sp.encode("get_weather\n") + tok.sp.encode('{"city": "北京"}') + [tok.token_id("<|observation|>")]
    pieces = ensemble_pieces(tok, ids, [1] * len(ids), end_without_ids=False)
    whole = postprocess(tok, *batch(ids))[0][0]
    assert whole.startswith("get_weather\n") and "北京" in whole
    assert "".join(pieces) == whole and pieces[0]  # the metadata line is not held back


def test_generated_ids_need_is_final(tok):
    tokens, lengths = batch([5])
    with pytest.raises(UsageError, match="GENERATED_IDS .* and IS_FINAL"):
        postprocess(tok, tokens, lengths, np.array([[[5]]], np.int32), None)


def flags(*values: bool) -> np.ndarray:
    return np.array([[v] for v in values], dtype=bool)


def text_inputs(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def test_text_output_is_flat_as_nvidias():
    """NVIDIA's postprocessing gives one flat entry per row and beam (its client reads text_output[0])."""
    texts = flat_texts([["A1", "A2"], ["B1", "B2"]])
    assert texts.shape == (4,) and texts.tolist() == [b"A1", b"A2", b"B1", b"B2"]


def test_the_prompt_leads_a_whole_reply_only_when_not_excluded():
    """exclude_input_in_output false (not streamed): text_input + reply, as NVIDIA's end_to_end_grpc_client checks
    it; absent it is true (tensorrt_llm's parameter); streamed pieces never hold the prompt."""
    prompts = text_inputs("天空", "sky ")
    assert reply_prefixes(prompts, None, False, 2).tolist() == [[b""], [b""]]
    prefixes = reply_prefixes(prompts, flags(False, True), False, 2)
    assert prefixes.tolist() == [["天空".encode()], [b""]]
    assert [t.decode() for t in flat_texts([["是蓝色的。"], ["blue"]], prefixes)] == ["天空是蓝色的。", "blue"]
    assert reply_prefixes(prompts, flags(False, False), True, 2).tolist() == [[b""], [b""]]


def test_asking_for_the_prompt_without_it_or_with_the_wrong_rows_is_a_usage_error():
    with pytest.raises(UsageError, match="needs the request's text"):
        reply_prefixes(None, flags(False), False, 1)
    with pytest.raises(UsageError, match="exclude_input_in_output must hold one value for each of the 2 sequences"):
        reply_prefixes(text_inputs("a", "b"), flags(False), False, 2)
    with pytest.raises(UsageError, match="text_input must hold one value for each of the 2 sequences, not 1"):
        reply_prefixes(text_inputs("a"), flags(False, False), False, 2)
