"""The tensorrt_llm model's requests: NVIDIA's input tensors -> the executor's Requests.

Inputs (batch first; each sequence of a request is a request of its own to the in-flight batcher,
as in NVIDIA's backend, which takes a batch of several only when decoupled): input_ids,
input_lengths, end_id, stop_words_list and bad_words_list (TensorRT-LLM's [2, n] ids/offsets
layout), embedding_bias, streaming, and the request's settings, each input as the one table of them
says (request_config.REQUEST_FIELDS: request_output_len, the output budget, and the sampling and
output settings, under NVIDIA's v0.19.0 or v1.2.1 names), checked against its bounds there and read by
TensorRT-LLM's rules (`request_config.engine_settings`). pad_id, beam_search_diversity_rate (beam search
only), runtime_top_p_min and runtime_top_p_reset_ids (top-p decay only) and decoder_input_ids of
one id (what NVIDIA's preprocessing sends a decoder-only model) are accepted and unused. Every
other input of NVIDIA's (LoRA, prompt tables, guided decoding, draft tokens, encoder inputs, ...) is
accepted absent or at its neutral value and refused otherwise, with an error naming it
(contract.Tensor.lacks). num_return_sequences n (one prompt per request) makes n sequences,
sequence k sampling with seed (the request's, 0 when unset) + k, as TensorRT-LLM's child requests
do. beam_width above 1 searches beams (runtime/beams.py; up to the engine's max_beam_width, which
the executor checks) and is not streamed: TensorRT-LLM's backend refuses "Streaming mode is only
supported with beam width of 1", and so does this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from trtglm.backend.contract import CONTRACT, FLAGGED_OUTPUTS, TENSORRT_LLM, flag_set, names, refuse_unhonoured
from trtglm.chatglm.chat import word_sequences
from trtglm.errors import UsageError, int32_range_error
from trtglm.request_config import FIELD, check_return_sequences, engine_settings
from trtglm.runtime.request import Request

INPUTS = names(CONTRACT[TENSORRT_LLM].inputs)
# NVIDIA's backend refuses a batch of several prompts in one request unless decoupled, in these words
BATCH_NEEDS_DECOUPLED = "Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy"
MAX_TOKENS = FIELD["max_tokens"]  # the output budget: request_output_len on tensorrt_llm's wire


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


def engine_requests(arrays: Mapping[str, np.ndarray | None], max_return_sequences: int) -> tuple[list[Request], bool]:
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
    count = return_sequences(arrays, max_return_sequences)
    parsed = [_row_request(arrays, row, batch) for row in range(batch)]
    streaming = {stream for _, stream in parsed}
    if len(streaming) > 1:
        raise UsageError("streaming must be the same for every sequence of a request")
    if len({request.sampling.beam_width for request, _ in parsed}) > 1:
        raise UsageError("beam_width must be the same for every sequence of a request")
    requests = [request for request, _ in parsed]
    return (sampled_copies(requests[0], count) if count > 1 else requests), streaming.pop()


def batch_size(arrays: Mapping[str, np.ndarray | None]) -> int:
    """How many prompts a request holds (input_ids' rows; 1 without input_ids, which is then refused)."""
    ids = arrays.get("input_ids")
    return 1 if ids is None or ids.ndim == 0 else len(ids)


def return_sequences(arrays: Mapping[str, np.ndarray | None], limit: int) -> int:
    """num_return_sequences (1 when absent): how many sequences one prompt gets (a request of one prompt), at most
    `limit`."""
    array = arrays.get("num_return_sequences")
    count = 1 if array is None or array.size == 0 else int(np.asarray(array).reshape(-1)[0])
    if count < 1:
        raise int32_range_error("num_return_sequences", count, 1)
    check_return_sequences(count, limit)
    if count > 1 and len(arrays["input_ids"]) > 1:
        raise UsageError(f"num_return_sequences {count} takes one prompt per request; this one has "
                         f"{len(arrays['input_ids'])}")
    return count


def sampled_copies(request: Request, count: int) -> list[Request]:
    """TensorRT-LLM's child requests: sequence k samples with the request's seed (0 when unset) + k."""
    seed = request.sampling.seed or 0
    return [dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed + k))
            for k in range(count)]


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
    refuse_unhonoured(TENSORRT_LLM, arrays)
    refuse_decoder_input(arrays)
    length = int(_one(arrays, "input_lengths", ids.shape[1]))
    if not 0 < length <= ids.shape[1]:
        raise UsageError(f"input_lengths {length} must be between 1 and the {ids.shape[1]} ids given")
    sampling, output = engine_settings(lambda field: _one_of(arrays, field.names("engine")))
    output_len, streaming = int(_one(arrays, MAX_TOKENS.engine)), bool(_one(arrays, "streaming", False))
    MAX_TOKENS.check(output_len, MAX_TOKENS.engine)
    if sampling.beam_width > 1 and streaming:
        raise UsageError(f"streaming takes beam_width 1, not {sampling.beam_width} (as TensorRT-LLM's backend): leave "
                         "streaming off to have every beam in one response")
    end_id, bias = int(_one(arrays, "end_id", -1)), arrays.get("embedding_bias")
    request = Request(
        prompt=[int(t) for t in ids[0, :length]],
        max_tokens=output_len,
        end_id=end_id if end_id >= 0 else None,
        stop_words=_words(arrays, "stop_words_list"),
        bad_words=_words(arrays, "bad_words_list"),
        embedding_bias=torch.from_numpy(np.asarray(bias, np.float32).reshape(-1).copy())
        if bias is not None and bias.size else None,
        sampling=sampling,
        output=output,
    )
    return request, streaming


def unasked_outputs(arrays: Mapping[str, np.ndarray | None]) -> set[str]:
    """The flagged outputs whose flag the request leaves false (for a batch, the first sequence's flag)."""
    return {output for flag, outputs in FLAGGED_OUTPUTS.items() if not flag_set(arrays.get(flag))
            for output in outputs}


def _one_of(arrays: Mapping[str, np.ndarray | None], names: tuple[str, ...]) -> tuple[str, object] | None:
    """(name, value) of whichever of an input's names (NVIDIA's older and newer) the request gives; None: neither."""
    given = [name for name in names if arrays.get(name) is not None]
    if len(given) == 2 and _one(arrays, names[0]) != _one(arrays, names[1]):
        raise UsageError(f"{names[0]} and {names[1]} are the same input under two names; give one")
    return (given[0], _one(arrays, given[0])) if given else None


def refuse_decoder_input(arrays: Mapping[str, np.ndarray | None]) -> None:
    """UsageError for decoder_input_ids beyond the one start id: an encoder-decoder model's input."""
    decoder_ids = arrays.get("decoder_input_ids")
    if decoder_ids is not None and decoder_ids.shape[-1] > 1:
        raise UsageError("decoder_input_ids: ChatGLM3 is decoder-only; give the prompt as input_ids")


def _words(arrays: Mapping[str, np.ndarray | None], name: str) -> list[list[int]]:
    array = arrays.get(name)
    if array is None:
        return []
    if array.ndim != 3 or array.shape[0] != 1:
        raise UsageError(f"{name} must be [1, 2, n] for each sequence, not {list(array.shape)}")
    return word_sequences(array[0], name)
