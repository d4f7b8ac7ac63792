"""NVIDIA's inputs that trtglm's runtime cannot honour (LoRA, prompt tables, guided decoding, draft tokens,
encoder and multimodal inputs, ...) are accepted left out or at their neutral value and refused, naming
the input, when set; the newer names of two inputs (min_tokens, seed) mean what the older ones do;
num_return_sequences makes that many sequences, seeded as TensorRT-LLM seeds its child requests."""

from __future__ import annotations

import numpy as np
import pytest

from trtglm.backend.contract import Limits
from trtglm.backend.llm_requests import engine_request
from trtglm.backend.preprocessing import preprocess
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError


def arrays(**values) -> dict[str, np.ndarray]:
    """One sequence's tensorrt_llm input arrays as Triton gives them (batch first)."""
    return {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
            "request_output_len": np.array([[4]], np.int32), **values}


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


# input -> (a value trtglm's runtime cannot honour, its neutral value), as NVIDIA's clients send them
ENGINE_INPUTS = {
    "lora_task_id": (np.array([[3]], np.uint64), np.array([[0]], np.uint64)),
    "lora_weights": (np.ones((1, 2, 8), np.float16), np.zeros((1, 0, 0), np.float16)),
    "lora_config": (np.array([[[0, 0, 4]]], np.int32), np.zeros((1, 0, 3), np.int32)),
    "prompt_embedding_table": (np.ones((1, 2, 4), np.float16), np.zeros((1, 0, 4), np.float16)),
    "prompt_table_extra_ids": (np.array([[0, 0, 7]], np.uint64), np.array([[0, 0, 0]], np.uint64)),
    "prompt_vocab_size": (np.array([[2]], np.int32), np.array([[0]], np.int32)),
    "guided_decoding_guide_type": (text("json"), text("")),
    "guided_decoding_guide": (text('{"type": "object"}'), text("")),
    "draft_input_ids": (np.array([[9, 10]], np.int32), np.zeros((1, 0), np.int32)),
    "draft_logits": (np.ones((1, 2, 8), np.float32), np.zeros((1, 0, 8), np.float32)),
    "encoder_input_features": (np.ones((1, 2, 4), np.float16), np.zeros((1, 0, 4), np.float16)),
    "runtime_top_p_decay": (np.array([[0.5]], np.float32), np.array([[1.0]], np.float32)),
    "lookahead_window_size": (np.array([[4]], np.int32), np.array([[0]], np.int32)),
    "stop": (np.array([[True]]), np.array([[False]])),
}


@pytest.mark.parametrize("name", ENGINE_INPUTS)
def test_the_engine_refuses_what_it_cannot_honour_and_takes_its_neutral_value(name):
    refused, neutral = ENGINE_INPUTS[name]
    with pytest.raises(UsageError, match=rf"^{name}: trtglm's runtime has no .*; leave {name} out$"):
        engine_request(arrays(**{name: refused}))
    request, _ = engine_request(arrays(**{name: neutral}))
    assert list(request.prompt) == [5, 6, 7]


def test_decoder_ids_of_one_pad_id_are_what_nvidias_preprocessing_sends_a_decoder_only_model():
    engine_request(arrays(decoder_input_ids=np.array([[0]], np.int32), decoder_input_lengths=np.array([[1]], np.int32)))
    with pytest.raises(UsageError, match="^decoder_input_ids: ChatGLM3 is decoder-only"):
        engine_request(arrays(decoder_input_ids=np.array([[5, 6]], np.int32)))


def test_min_tokens_and_seed_are_min_length_and_random_seed_under_their_newer_names():
    newer = engine_request(arrays(min_tokens=np.array([[3]], np.int32), seed=np.array([[11]], np.uint64)))[0].sampling
    older = engine_request(arrays(min_length=np.array([[3]], np.int32),
                                  random_seed=np.array([[11]], np.uint64)))[0].sampling
    assert (newer.min_tokens, newer.seed) == (older.min_tokens, older.seed) == (3, 11)
    with pytest.raises(UsageError, match="^min_length and min_tokens are the same input under two names; give one$"):
        engine_request(arrays(min_tokens=np.array([[3]], np.int32), min_length=np.array([[2]], np.int32)))


@pytest.mark.parametrize("name, client_name, refused, neutral", [
    ("DECODER_QUERY", "decoder_text_input", text("translate"), text("")),
    ("PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id", np.array([[4]], np.uint64), np.array([[0]], np.uint64)),
    ("IMAGE_URL", "IMAGE_URL", text("http://127.0.0.1/cat.png"), text("")),
    ("IMAGE_BYTES", "IMAGE_BYTES", np.ones((1, 1, 2, 2, 3), np.uint8), np.zeros((1, 0, 0, 0, 0), np.uint8)),
])
def test_preprocessing_refuses_decoder_queries_prompt_tables_and_images(fixture_dir, name, client_name, refused,
                                                                         neutral):
    tokenizer, limits = ChatGLMTokenizer(fixture_dir), Limits(256, 512, 65024)
    request = {"QUERY": text("hi"), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)}
    with pytest.raises(UsageError, match=rf"^{client_name}: trtglm's runtime has no "):
        preprocess(tokenizer, limits, {**request, name: refused})
    out = preprocess(tokenizer, limits, {**request, name: neutral})
    # a decoder-only model's decoder ids: one pad id, as NVIDIA's preprocessing gives without a decoder query
    assert out["DECODER_INPUT_ID"].tolist() == out["OUT_PAD_ID"].tolist()
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1]]


def test_num_return_sequences_makes_sequences_seeded_one_apart():
    from trtglm.backend.llm_requests import engine_requests

    sampled = {"runtime_top_k": np.array([[8]], np.int32), "num_return_sequences": np.array([[3]], np.int32)}
    requests, _ = engine_requests(arrays(**sampled, random_seed=np.array([[40]], np.uint64)), 8)
    assert [r.sampling.seed for r in requests] == [40, 41, 42] and all(list(r.prompt) == [5, 6, 7] for r in requests)
    unseeded, _ = engine_requests(arrays(**sampled), 8)
    assert [r.sampling.seed for r in unseeded] == [0, 1, 2]  # TensorRT-LLM's seed when unset is 0
    with pytest.raises(UsageError, match="^num_return_sequences must be between 1 and"):
        engine_requests(arrays(num_return_sequences=np.array([[0]], np.int32)), 8)
    two_prompts = {"input_ids": np.array([[5, 6], [7, 8]], np.int32), "input_lengths": np.array([[2], [2]], np.int32),
                   "request_output_len": np.array([[4], [4]], np.int32),
                   "num_return_sequences": np.array([[2], [2]], np.int32)}
    with pytest.raises(UsageError, match="^num_return_sequences 2 takes one prompt per request; this one has 2$"):
        engine_requests(two_prompts, 8)


@pytest.mark.parametrize("count", [9, 10**6, 2**31 - 1])
def test_num_return_sequences_past_the_servers_limit_is_refused_before_any_sequence_is_made(count):
    from trtglm.backend.llm_requests import engine_requests

    with pytest.raises(UsageError, match=f"^num_return_sequences {count} is more than this server allows "
                                         r"\(8, its serve.max_return_sequences\)$"):
        engine_requests(arrays(num_return_sequences=np.array([[count]], np.int32)), 8)
    requests, _ = engine_requests(arrays(runtime_top_k=np.array([[8]], np.int32),
                                         num_return_sequences=np.array([[8]], np.int32)), 8)
    assert len(requests) == 8
