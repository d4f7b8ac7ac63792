"""ChatGLM3 preprocessing, called as Triton calls it (batch-first arrays by tensor name), checked
against the chat format of shared/reference/chatglm3.md and TensorRT-LLM's word-list layout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtglm.backend import preprocessing
from trtglm.backend.contract import Limits
from trtglm.backend.preprocessing import preprocess, refuse_streaming
from trtglm.chatglm.chat import chat_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.request_config import MAX_WORD_BYTES, MAX_WORDS

LIMITS = Limits(max_input_len=384, max_seq_len=512, vocab_size=1024)


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module")
def conversations(fixture_dir) -> list[dict]:
    return [json.loads(line) for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]


def strings(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def request(*texts: str, max_tokens: int = 16, **extra) -> dict:
    """The arrays Triton gives for a request of len(texts) rows (optional inputs by tensor name)."""
    return {"QUERY": strings(*texts), "REQUEST_OUTPUT_LEN": np.full((len(texts), 1), max_tokens, np.int32), **extra}


def chat_prompt(tok: ChatGLMTokenizer, messages: list[dict]) -> list[int]:
    """chatglm3.md: [gMASK] sop, per message <|role|> + encode(metadata + "\\n") + encode(content), <|assistant|>."""
    ids = [tok.special_ids["[gMASK]"], tok.special_ids["sop"]]
    for m in messages:
        content = m["content"] + ("\n" + json.dumps(m["tools"], indent=4, ensure_ascii=False) if m.get("tools") else "")
        role = tok.special_ids[f"<|{m['role']}|>"]
        ids += [role] + tok.sp.encode(m.get("metadata", "") + "\n") + tok.sp.encode(content)
    return ids + [tok.special_ids["<|assistant|>"]]


def words(word_list: np.ndarray) -> list[list[int]]:
    """TensorRT-LLM's [2, n] layout back to words: row 0 ids, row 1 end offsets (-1 padded)."""
    ends = [int(e) for e in word_list[1] if e >= 0]
    starts = ([0] + ends)[:len(ends)]
    return [word_list[0][start:end].tolist() for start, end in zip(starts, ends, strict=True)]


def test_plain_text_is_one_user_message_in_the_chat_template(tok):
    out = preprocess(tok, LIMITS, request("What color is the sky?"))
    expected = chat_prompt(tok, [{"role": "user", "content": "What color is the sky?"}])
    assert out["INPUT_ID"].tolist() == [expected]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(expected)]]
    assert expected[:3] == [tok.special_ids["[gMASK]"], tok.special_ids["sop"], tok.special_ids["<|user|>"]]
    assert out["INPUT_ID"].dtype == np.int32


def test_json_chats_match_chat_ids(tok, conversations):
    for conversation in conversations:
        messages = conversation["messages"]
        for text in (json.dumps({"messages": messages}, ensure_ascii=False), json.dumps(messages)):
            out = preprocess(tok, LIMITS, request(text))
            assert out["INPUT_ID"][0].tolist() == chat_prompt(tok, messages) == chat_ids(tok, messages)


def test_role_tokens_typed_by_a_user_stay_text(tok):
    out = preprocess(tok, LIMITS, request("What is <|user|>?"))
    assert out["INPUT_ID"][0].tolist().count(tok.special_ids["<|user|>"]) == 1  # only the real turn marker


def test_json_that_is_not_a_chat_is_plain_text(tok):
    for text in ('[1, 2, 3] sorted?', "[1, 2]", '{"a": 1}', "[not json"):
        out = preprocess(tok, LIMITS, request(text))
        assert out["INPUT_ID"][0].tolist() == chat_prompt(tok, [{"role": "user", "content": text}])


@pytest.mark.parametrize("text, message", [
    ("", "text_input is empty"),
    ("   \n", "text_input is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}', "looks like a JSON chat but is not valid JSON"),
    ('[{"role": "user", "content": "hi"},]', "looks like a JSON chat but is not valid JSON"),
    ('{"messages": []}', 'text_input: "messages" must be a non-empty list'),
    ("[]", "text_input is an empty chat"),
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
    ('[{"role": "bot", "content": "hi"}]', "role must be one of system, user, assistant, observation, not 'bot'"),
    ('[{"role": "user"}]', "message 0: has no content"),
    ('{"messages": [{"role": "user", "content": "hi"}, "oops"]}', "message 1: expected a dict"),
])
def test_bad_input_is_a_usage_error(tok, text, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[")):
        preprocess(tok, LIMITS, request(text))


def test_json_is_never_evaluated(tok):
    text = "[{'role': 'user', 'content': __import__('os').getcwd()}]"  # Python, not JSON
    with pytest.raises(UsageError, match="not valid JSON"):
        preprocess(tok, LIMITS, request(text))


@pytest.mark.parametrize("max_tokens, message", [
    (0, "max_tokens must be between 1 and 2147483647, not 0$"),
    # 2**31 sent as JSON reaches the model as the low 32 bits of it: the message names what was sent
    (-2**31, r"max_tokens must be between 1 and 2147483647, not -2147483648 \(over HTTP JSON Triton keeps only the "
             r"low 32 bits of a larger number: 2147483648 arrives as -2147483648\)"),
])
def test_max_tokens_must_fit_and_be_positive(tok, max_tokens, message):
    with pytest.raises(UsageError, match=message):
        preprocess(tok, LIMITS, request("hi", max_tokens=max_tokens))


def test_prompt_longer_than_max_input_len_is_refused(tok):
    text = "What color is the sky? " * 60
    n = len(chat_prompt(tok, [{"role": "user", "content": text}]))
    assert n > LIMITS.max_input_len
    with pytest.raises(UsageError, match=f"the prompt is {n} tokens, more than the engine's max_input_len \\(384\\)"):
        preprocess(tok, LIMITS, request(text))
    short = Limits(max_input_len=n, max_seq_len=n + 4, vocab_size=1024)
    assert preprocess(tok, short, request(text, max_tokens=4))["REQUEST_INPUT_LEN"][0, 0] == n
    # more than fits is the engine's to cut to what fits (as TensorRT-LLM's executor does), not refused here
    assert preprocess(tok, short, request(text, max_tokens=5))["REQUEST_OUTPUT_LEN"][0, 0] == 5


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tok, monkeypatch):
    text = "天空是什么颜色？" * 400_000  # 9.6 MB
    monkeypatch.setattr(type(tok), "encode", lambda *args, **kwargs: pytest.fail("tokenized"), raising=False)
    monkeypatch.setattr(preprocessing, "prompt_ids", lambda *args, **kwargs: pytest.fail("tokenized"))
    with pytest.raises(UsageError, match=r"the prompt \(9,600,000 bytes\) is longer than the engine's max_input_len "
                                         r"\(384 tokens\) can hold"):
        preprocess(tok, LIMITS, request(text))


def test_the_byte_bound_never_refuses_a_prompt_that_fits(tok):
    """Every prompt of the fixture's training set fits in 4 × bytes-per-longest-piece of its token count."""
    for text in ("What color is the sky?", "天空是什么颜色？" * 20, "x" * 200, " " * 300, "<0xE4>" * 30):
        n = len(chat_prompt(tok, [{"role": "user", "content": text}]))
        assert len(text.encode()) <= 4 * n * tok.longest_piece_bytes


def test_deeply_nested_json_is_refused_in_one_line(tok):
    with pytest.raises(UsageError, match="nests JSON too deeply"):
        preprocess(tok, LIMITS, request("[" * 2_000 + "]" * 2_000))


def test_end_and_pad_ids_default_to_chatglm3s_and_follow_the_client(tok):
    out = preprocess(tok, LIMITS, request("hi", "hello"))
    assert out["OUT_END_ID"].tolist() == [[2], [2]] and out["OUT_PAD_ID"].tolist() == [[0], [0]]
    assert tok.sp.id_to_piece(2) == "</s>" and tok.sp.id_to_piece(0) == "<unk>"
    out = preprocess(tok, LIMITS, request("hi", END_ID=np.array([[7]], np.int32), PAD_ID=np.array([[3]], np.int32)))
    assert out["OUT_END_ID"].tolist() == [[7]] and out["OUT_PAD_ID"].tolist() == [[3]]
    with pytest.raises(UsageError, match="end_id 99999 is not a token id"):
        preprocess(tok, LIMITS, request("hi", END_ID=np.array([[99999]], np.int32)))


def test_stop_words_always_hold_user_and_observation(tok):
    out = preprocess(tok, LIMITS, request("hi"))
    assert out["STOP_WORDS_IDS"].shape == (1, 2, 2) and out["STOP_WORDS_IDS"].dtype == np.int32
    assert words(out["STOP_WORDS_IDS"][0]) == [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]]
    assert words(out["BAD_WORDS_IDS"][0]) == [] and out["BAD_WORDS_IDS"][0].tolist() == [[0], [-1]]


def test_client_stop_and_bad_words_become_ids(tok):
    stop = np.array([[b"Paris", b"<|system|>", b""]], dtype=np.object_)
    bad = np.array([[b"blue"]], dtype=np.object_)
    out = preprocess(tok, LIMITS, request("hi", STOP_WORDS_DICT=stop, BAD_WORDS_DICT=bad))
    after_space = tok.sp.encode("Paris")  # "▁Paris": at the start of a line or after a space
    after_text = tok.sp.encode("\nParis")[len(tok.sp.encode("\n")):]  # right after other text
    assert after_space != after_text
    assert words(out["STOP_WORDS_IDS"][0]) == [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]],
                                               after_space, after_text, [tok.special_ids["<|system|>"]]]
    assert words(out["BAD_WORDS_IDS"][0])[0] == tok.sp.encode("blue")


def test_stop_and_bad_words_are_bounded_in_count_and_bytes(tok):
    """MAX_WORDS words of MAX_WORD_BYTES bytes pass; one more word, or one more byte, is refused by name."""
    most = np.array([[("é" * (MAX_WORD_BYTES // 2)).encode()] * MAX_WORDS], dtype=np.object_)
    preprocess(tok, LIMITS, request("hi", STOP_WORDS_DICT=most, BAD_WORDS_DICT=most))
    for name, client in (("STOP_WORDS_DICT", "stop_words"), ("BAD_WORDS_DICT", "bad_words")):
        with pytest.raises(UsageError, match=f"{client}: at most {MAX_WORDS} words, not {MAX_WORDS + 1}"):
            preprocess(tok, LIMITS, request("hi", **{name: np.array([[b"w"] * (MAX_WORDS + 1)], dtype=np.object_)}))
        longer = np.array([[("é" * (MAX_WORD_BYTES // 2) + "e").encode()]], dtype=np.object_)
        with pytest.raises(UsageError, match=f"{client}: a word may hold at most {MAX_WORD_BYTES} bytes, not "
                                             f"{MAX_WORD_BYTES + 1}"):
            preprocess(tok, LIMITS, request("hi", **{name: longer}))


def test_batch_rows_are_padded_with_the_pad_id(tok):
    out = preprocess(tok, LIMITS, request("hi", "What is the capital of France?",
                                          STOP_WORDS_DICT=np.array([[b"x"], [b""]], dtype=np.object_)))
    short, long = (chat_prompt(tok, [{"role": "user", "content": t}]) for t in ("hi", "What is the capital of France?"))
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(short)], [len(long)]]
    assert out["INPUT_ID"].tolist() == [short + [0] * (len(long) - len(short)), long]
    first, second = out["STOP_WORDS_IDS"]
    assert words(second) == words(first)[:2] and len(words(first)) > 2  # padded rows keep their own words


def test_embedding_bias(tok):
    out = preprocess(tok, LIMITS, request("hi"))
    assert out["EMBEDDING_BIAS"].shape == (1, 0)
    bias_words = np.array([[b"blue"]], dtype=np.object_)
    out = preprocess(tok, LIMITS, request("hi", EMBEDDING_BIAS_WORDS=bias_words,
                                          EMBEDDING_BIAS_WEIGHTS=np.array([[2.5]], np.float32)))
    bias = out["EMBEDDING_BIAS"][0]
    assert bias.shape == (LIMITS.vocab_size,) and bias.dtype == np.float32
    assert set(np.flatnonzero(bias)) >= set(tok.sp.encode("blue")) and set(bias[bias != 0]) == {2.5}
    with pytest.raises(UsageError, match="1 entries but embedding_bias_weights has 0"):
        preprocess(tok, LIMITS, request("hi", EMBEDDING_BIAS_WORDS=bias_words))


def test_invalid_utf8_is_a_usage_error(tok):
    with pytest.raises(UsageError, match="text_input is not valid UTF-8"):
        preprocess(tok, LIMITS, {"QUERY": np.array([[b"\xff\xfe"]], dtype=np.object_),
                                 "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)})


def test_streaming_request_is_sent_to_the_bls_model():
    refuse_streaming(None)
    refuse_streaming(np.array([[False]]))
    with pytest.raises(UsageError, match="stream with the tensorrt_llm_bls model"):
        refuse_streaming(np.array([[True]]))


def test_a_chatglm2_engine_gets_chatglm2s_prompt(tok):
    chatglm2 = Limits(max_input_len=384, max_seq_len=512, vocab_size=1024, chatglm_version="chatglm2")
    out = preprocess(tok, chatglm2, request("What color is the sky?"))
    expected = [tok.special_ids["[gMASK]"], tok.special_ids["sop"], *tok.sp.encode(
        "[Round 1]\n\n问：What color is the sky?\n\n答：")]
    assert out["INPUT_ID"].tolist() == [expected]


@pytest.mark.parametrize("params, version", [({}, "chatglm3"), ({"chatglm_version": "chatglm2"}, "chatglm2")])
def test_limits_read_the_prompt_format(params, version):
    numbers = {"max_input_len": "384", "max_seq_len": "512", "vocab_size": "1024"}
    assert Limits.from_parameters({**numbers, **params}, "preprocessing").chatglm_version == version
    with pytest.raises(UsageError, match="preprocessing: parameter chatglm_version must be one of chatglm3, "
                                         "chatglm2, not 'glm4'"):
        Limits.from_parameters({**numbers, "chatglm_version": "glm4"}, "preprocessing")


@pytest.mark.parametrize("missing, message", [(("QUERY",), "text_input is required"),
                                              (("REQUEST_OUTPUT_LEN",), "max_tokens is required"),
                                              (("QUERY", "REQUEST_OUTPUT_LEN"), "text_input and max_tokens are required")])
def test_a_missing_required_input_is_refused_by_the_clients_name(tok, missing, message):
    """The client models declare them optional (contract.REQUIRED_BY_PREPROCESSING): this is where they are refused."""
    inputs = {name: value for name, value in request("hi").items() if name not in missing}
    with pytest.raises(UsageError, match=f"^{message}$"):
        preprocess(tok, LIMITS, inputs)
