"""return_context_logits and return_generation_logits through a launched server (`trtglm launch` of the
fixture's repository, decoupled), against transformers' GlmForCausalLM: the tensorrt_llm model with token ids,
streamed and not, in NVIDIA's shapes (context `[1, prompt, vocab]`; generation `[1, beam, tokens, vocab]`, or
streamed `[1, tokens, beam, vocab]` of each response's new tokens; vocab the engine's padded one, 576, past the
tokenizer's 521 ids); each beam's of a beam search; the ensemble and the BLS model passing them through; and a request whose logits would
pass the cap refused with one line while the server goes on."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
from support.references import glm_reference, greedy_with_logits  # noqa: F401 (fixture)
from support.servers import Launched, triton_type

from trtglm.chatglm.chat import chat_ids, prompt_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.runtime.request import MAX_LOGITS_ENV

pytestmark = pytest.mark.slow
VOCAB, TOKENIZER_IDS = 576, 521  # the fixture engine's padded vocabulary; the ids its tokenizer has
END_ID, STOPS, NEW = 2, (518, 520), 24  # </s>; <|user|>, <|observation|> (the ensemble's default stop words)
QUESTION = "Write a poem about the moon."  # not one the fixture learnt: its logits are far from one-hot
ATOL = 2e-3
FLAGS = {"return_context_logits": np.array([[True]]), "return_generation_logits": np.array([[True]])}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    launched = Launched(tmp_path_factory.mktemp("logits"), build_flags=("--set", "build.max_beam_width=2"))
    launched.env[MAX_LOGITS_ENV] = "1"  # 455 rows of 576 float32 logits: the fixture's longest requests pass it
    try:
        launched.start()
        yield launched
    finally:
        launched.stop()


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


def stream_infer(server: Launched, model: str, inputs: dict[str, np.ndarray]) -> list:
    """Every response of one request over a gRPC stream, until the final one (errors raise)."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(server.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, array in inputs.items():
        tensors.append(grpc.InferInput(name, list(array.shape), triton_type(array)))
        tensors[-1].set_data_from_numpy(array)
    client.async_stream_infer(model, tensors, enable_empty_final_response=True)
    responses = []
    try:
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            if result.get_response().outputs:
                responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def ids_inputs(prompt: list[int], streaming: bool) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[NEW]], np.int32), "end_id": np.array([[END_ID]], np.int32),
            "streaming": np.array([[streaming]]), **FLAGS}


def text_inputs(streaming: bool) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[QUESTION.encode()]], dtype=object), "max_tokens": np.array([[NEW]], np.int32),
            "stream": np.array([[streaming]]), **FLAGS}


def check_context(responses: list, context: np.ndarray) -> None:
    """Every response carries the prompt's logits (as TensorRT-LLM's executor puts them in every result)."""
    for response in responses:
        np.testing.assert_allclose(response.as_numpy("context_logits"), context[None], atol=ATOL)


def test_tensorrt_llm_returns_transformers_logits_whole(server, tok, glm_reference):
    prompt = chat_ids(tok, [{"role": "user", "content": QUESTION}])
    ids, context, generation = greedy_with_logits(glm_reference, prompt, NEW, END_ID, choosable=TOKENIZER_IDS)
    response, = stream_infer(server, "tensorrt_llm", ids_inputs(prompt, streaming=False))
    assert response.as_numpy("output_ids")[0, 0].tolist() == ids
    assert response.as_numpy("context_logits").shape == (1, len(prompt), VOCAB)
    check_context([response], context)
    assert response.as_numpy("generation_logits").shape == (1, 1, len(ids), VOCAB)
    np.testing.assert_allclose(response.as_numpy("generation_logits")[0, 0], generation, atol=ATOL)
    assert np.abs(generation).max() > 1.0  # far from what zeros would pass


def test_tensorrt_llm_streams_each_responses_new_tokens_logits(server, tok, glm_reference):
    prompt = chat_ids(tok, [{"role": "user", "content": QUESTION}])
    ids, context, generation = greedy_with_logits(glm_reference, prompt, NEW, END_ID, choosable=TOKENIZER_IDS)
    responses = stream_infer(server, "tensorrt_llm", ids_inputs(prompt, streaming=True))
    check_context(responses, context)
    counts = [len(r.as_numpy("output_ids")[0, 0]) for r in responses]
    shapes = [r.as_numpy("generation_logits").shape for r in responses]
    assert shapes == [(1, count, 1, VOCAB) for count in counts]
    rows = np.concatenate([r.as_numpy("generation_logits")[0, :, 0] for r in responses])
    np.testing.assert_allclose(rows, generation, atol=ATOL)
    assert sum(counts) == len(ids)


def test_a_beam_search_returns_each_beams_logits(server, tok, glm_reference):
    prompt = chat_ids(tok, [{"role": "user", "content": QUESTION}])
    _, context, _ = greedy_with_logits(glm_reference, prompt, 0, END_ID)
    response, = stream_infer(server, "tensorrt_llm", {**ids_inputs(prompt, streaming=False),
                                                      "beam_width": np.array([[2]], np.int32)})
    check_context([response], context)
    logits, lengths = response.as_numpy("generation_logits"), response.as_numpy("sequence_length")[0]
    assert logits.shape == (1, 2, max(lengths), VOCAB)
    for beam, length in enumerate(lengths):
        ids = response.as_numpy("output_ids")[0, beam, :length].tolist()
        with torch.no_grad():
            expected = glm_reference(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].numpy()
        np.testing.assert_allclose(logits[0, beam, :length], expected, atol=ATOL)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_ensemble_and_bls_pass_the_logits_through(server, tok, glm_reference, model, streaming):
    """Streamed, the BLS model may end with the text it held back alone (no new tokens, so no logits)."""
    prompt = prompt_ids(tok, QUESTION)
    ids, context, generation = greedy_with_logits(glm_reference, prompt, NEW, END_ID, STOPS, choosable=TOKENIZER_IDS)
    responses = stream_infer(server, model, text_inputs(streaming))
    carrying = [r for r in responses if r.as_numpy("generation_logits") is not None]
    assert len(carrying) >= len(responses) - (model == "tensorrt_llm_bls" and streaming) >= 1
    check_context(carrying, context)
    parts = [r.as_numpy("generation_logits") for r in carrying]
    rows = np.concatenate([part[0, :, 0] for part in parts]) if streaming else parts[-1][0, 0]
    np.testing.assert_allclose(rows, generation, atol=ATOL)


def test_logits_past_the_cap_are_refused_and_the_server_goes_on(server, tok, glm_reference):
    long_prompt = (chat_ids(tok, [{"role": "user", "content": QUESTION}]) * 20)[:250]
    inputs = {**ids_inputs(long_prompt, streaming=False), "request_output_len": np.array([[256]], np.int32)}
    with pytest.raises(Exception) as refused:
        stream_infer(server, "tensorrt_llm", inputs)
    assert "return_context_logits and return_generation_logits: 506 rows of 576 float32 logits take 1.1 MiB, " \
           f"more than the 1 MiB a request may ask for ({MAX_LOGITS_ENV})" in str(refused.value)
    test_tensorrt_llm_returns_transformers_logits_whole(server, tok, glm_reference)
