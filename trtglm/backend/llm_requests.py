"""The tensorrt_llm model's requests: NVIDIA's input tensors -> the executor's Requests.

Inputs (batch first; each sequence of a request is a request of its own to the in-flight batcher,
as in NVIDIA's backend):
input_ids, input_lengths, request_output_len, end_id, stop_words_list and bad_words_list
(TensorRT-LLM's [2, n] ids/offsets layout), embedding_bias, min_length, temperature,
runtime_top_k, runtime_top_p, random_seed, return_log_probs, streaming, beam_width,
len_penalty and early_stopping (beam search). pad_id is accepted and unused. Sampling follows
TensorRT-LLM: with neither runtime_top_k nor runtime_top_p above 0 the choice is greedy;
otherwise temperature (default 1), then top-k, then top-p; repetition_penalty,
presence_penalty and frequency_penalty as TensorRT-LLM applies them (runtime/sampling.py).
beam_width above 1 searches beams (runtime/beams.py; up to the engine's max_beam_width, which
the executor checks) and is not streamed: TensorRT-LLM's backend refuses "Streaming mode is only
supported with beam width of 1", and so does this one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from trtglm.backend.contract import CONTRACT, TENSORRT_LLM, names
from trtglm.chatglm.chat import word_sequences
from trtglm.errors import UsageError, int32_range_error
from trtglm.runtime.executor import Request

INPUTS = names(CONTRACT[TENSORRT_LLM].inputs)


def _one(arrays: Mapping[str, np.ndarray | None], name: str, default=None):
    array = arrays.get(name)
    if array is None:
        if default is None:
            raise UsageError(f"{name} is required")
        return default
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise UsageError(f"{name} must hold one value for each sequence, not {values.size}")
    return values[0].item()


def engine_requests(arrays: Mapping[str, np.ndarray | None]) -> tuple[list[Request], bool]:
    """One executor Request per sequence of a request's input arrays (batch first), and whether to stream.

    As in NVIDIA's backend, each sequence of a batch is a request of its own to the in-flight batcher."""
    ids = arrays.get("input_ids")
    if ids is None:
        raise UsageError("input_ids is required")
    if ids.ndim != 2 or ids.shape[0] < 1:
        raise UsageError(f"input_ids must be [batch, ids], not {list(ids.shape)}")
    batch = ids.shape[0]
    for name, array in arrays.items():
        if array is not None and (array.ndim == 0 or array.shape[0] != batch):
            raise UsageError(f"{name} has {array.shape[0] if array.ndim else 0} rows for the {batch} sequences of "
                             "input_ids")
    parsed = [_row_request(arrays, row, batch) for row in range(batch)]
    streaming = {stream for _, stream in parsed}
    if len(streaming) > 1:
        raise UsageError("streaming must be the same for every sequence of a request")
    if batch > 1 and True in streaming:
        raise UsageError(f"streaming takes one sequence per request; this one has {batch}: stream each as its own "
                         "request, or leave streaming off to have every reply in one response")
    if len({request.beam_width for request, _ in parsed}) > 1:
        raise UsageError("beam_width must be the same for every sequence of a request")
    return [request for request, _ in parsed], streaming.pop()


def _row_request(arrays: Mapping[str, np.ndarray | None], row: int, batch: int) -> tuple[Request, bool]:
    one_row = {name: None if array is None else array[row:row + 1] for name, array in arrays.items()}
    try:
        return engine_request(one_row)
    except UsageError as e:
        if batch == 1:
            raise
        raise UsageError(f"sequence {row} of {batch}: {e}") from None


def engine_request(arrays: Mapping[str, np.ndarray | None]) -> tuple[Request, bool]:
    """The executor's Request and whether to stream, from one sequence's input arrays (batch 1 first)."""
    ids = arrays.get("input_ids")
    if ids is None:
        raise UsageError("input_ids is required")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise UsageError(f"input_ids must be [1, ids] for one sequence, not {list(ids.shape)}")
    length = int(_one(arrays, "input_lengths", ids.shape[1]))
    if not 0 < length <= ids.shape[1]:
        raise UsageError(f"input_lengths {length} must be between 1 and the {ids.shape[1]} ids given")
    beams, streaming = int(_one(arrays, "beam_width", 1)), bool(_one(arrays, "streaming", False))
    if beams < 1:
        raise int32_range_error("beam_width", beams, 1)
    if beams > 1 and streaming:
        raise UsageError(f"streaming takes beam_width 1, not {beams} (as TensorRT-LLM's backend): leave streaming "
                         "off to have every beam in one response")
    top_k, top_p = int(_one(arrays, "runtime_top_k", 0)), float(_one(arrays, "runtime_top_p", 0.0))
    output_len, min_length = int(_one(arrays, "request_output_len")), int(_one(arrays, "min_length", 0))
    for name, value, low in (("request_output_len", output_len, 1), ("runtime_top_k", top_k, 0),
                             ("min_length", min_length, 0)):
        if value < low:
            raise int32_range_error(name, value, low)
    sampled = top_k > 0 or top_p > 0
    end_id = int(_one(arrays, "end_id", -1))
    bias, seed = arrays.get("embedding_bias"), arrays.get("random_seed")
    request = Request(
        prompt=[int(t) for t in ids[0, :length]],
        max_new_tokens=output_len,
        end_id=end_id if end_id >= 0 else None,
        stop_words=_words(arrays, "stop_words_list"),
        bad_words=_words(arrays, "bad_words_list"),
        min_length=min_length,
        embedding_bias=torch.from_numpy(np.asarray(bias, np.float32).reshape(-1).copy())
        if bias is not None and bias.size else None,
        temperature=float(_one(arrays, "temperature", 1.0)) if sampled else 0.0,
        top_k=top_k,
        top_p=top_p if top_p > 0 else 1.0,
        seed=int(_one(arrays, "random_seed")) if seed is not None else None,
        log_probs=bool(_one(arrays, "return_log_probs", False)),
        repetition_penalty=float(_one(arrays, "repetition_penalty", 1.0)),
        presence_penalty=float(_one(arrays, "presence_penalty", 0.0)),
        frequency_penalty=float(_one(arrays, "frequency_penalty", 0.0)),
        beam_width=beams,
        length_penalty=float(_one(arrays, "len_penalty", 1.0)),
        early_stopping=int(_one(arrays, "early_stopping", 1)),
    )
    return request, streaming


def _words(arrays: Mapping[str, np.ndarray | None], name: str) -> list[list[int]]:
    array = arrays.get(name)
    if array is None:
        return []
    if array.ndim != 3 or array.shape[0] != 1:
        raise UsageError(f"{name} must be [1, 2, n] for each sequence, not {list(array.shape)}")
    return word_sequences(array[0], name)
