"""ChatGLM3 preprocessing: a request's text and options -> the engine's input tensors.

`preprocess` takes the request's arrays by tensor name (batch first, as Triton gives them) and
returns the output arrays by name:

| input (ensemble name) | output |
|---|---|
| QUERY (text_input): one message or a JSON chat | INPUT_ID, REQUEST_INPUT_LEN: the chat prompt's ids (ChatGLM2's format when the chatglm_version parameter says chatglm2) |
| REQUEST_OUTPUT_LEN (max_tokens) ≥ 1 | REQUEST_OUTPUT_LEN |
| END_ID / PAD_ID (end_id / pad_id), optional | OUT_END_ID / OUT_PAD_ID: the client's, else `</s>` 2 and `<unk>` 0 |
| STOP_WORDS_DICT (stop_words), optional | STOP_WORDS_IDS: `<|user|>`, `<|observation|>` and the client's words |
| BAD_WORDS_DICT (bad_words), optional | BAD_WORDS_IDS |
| EMBEDDING_BIAS_WORDS / _WEIGHTS, optional | EMBEDDING_BIAS: [vocab] or [0] |

A prompt longer than the engine's max_input_len is refused with a UsageError, which the model
returns as an error response (a max_tokens past what max_seq_len leaves is the engine's to cut,
as TensorRT-LLM's executor does). So is STREAM (stream) true, which the ensemble routes here when NVIDIA's
tensorrtllm backend serves the engine: its responses carry only their new ids, and an
ensemble's postprocessing may read nothing but those (Triton forbids mixing them with tensors
from before the engine), so it could not continue a request's text across streamed
responses; tensorrt_llm_bls streams instead. With trtglm's runtime the ensemble sends
`stream` to tensorrt_llm, never here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trtglm.backend import triton_io
from trtglm.backend.contract import CONTRACT, ENSEMBLE, PREPROCESSING, Limits, feeds, names, refuse_unhonoured
from trtglm.backend.triton_io import pb_utils
from trtglm.chatglm.chat import bad_sequences, prompt_ids, stack_word_lists, stop_sequences, word_ids, word_list
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.request_config import FIELD, check_words

INPUTS = names(CONTRACT[PREPROCESSING].inputs)
# what the client calls each input (ensemble and BLS), for error messages
CLIENT_NAMES = {name: client for client, name in feeds(ENSEMBLE, PREPROCESSING).items()}


@dataclass(frozen=True)
class Prepared:
    """One batch row, ready for the engine."""

    ids: list[int]
    output_len: int
    end_id: int
    pad_id: int
    stop_words: np.ndarray
    bad_words: np.ndarray
    bias: np.ndarray


def preprocess(tokenizer: ChatGLMTokenizer, limits: Limits, inputs: dict[str, np.ndarray | None]) -> dict:
    """Output arrays by name for one request (any batch size); UsageError for a bad request."""
    missing = [CLIENT_NAMES[name] for name in ("QUERY", "REQUEST_OUTPUT_LEN") if inputs.get(name) is None]
    if missing:
        raise UsageError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    refuse_unhonoured(PREPROCESSING, inputs, CLIENT_NAMES)
    rows = [prepare(tokenizer, limits, inputs, row) for row in range(len(inputs["QUERY"]))]
    return assemble(rows)


def prepare(tokenizer: ChatGLMTokenizer, limits: Limits, inputs: dict, row: int) -> Prepared:
    text = _one_text(inputs, "QUERY", row)
    limits.check_prompt_bytes(len(text.encode("utf-8")), tokenizer.longest_piece_bytes)
    ids = prompt_ids(tokenizer, text, name=CLIENT_NAMES["QUERY"], version=limits.chatglm_version)
    output_len = _one_int(inputs, "REQUEST_OUTPUT_LEN", row)
    FIELD["max_tokens"].check(output_len, CLIENT_NAMES["REQUEST_OUTPUT_LEN"])
    limits.check_prompt_tokens(len(ids))
    bias_words = _texts(inputs, "EMBEDDING_BIAS_WORDS", row)
    bias_weights = _floats(inputs, "EMBEDDING_BIAS_WEIGHTS", row)
    return Prepared(
        ids=ids,
        output_len=output_len,
        end_id=_token_id(tokenizer, inputs, "END_ID", row, tokenizer.eos_id),
        pad_id=_token_id(tokenizer, inputs, "PAD_ID", row, tokenizer.pad_id),
        stop_words=word_list(stop_sequences(tokenizer, _words(inputs, "STOP_WORDS_DICT", row))),
        bad_words=word_list(bad_sequences(tokenizer, _words(inputs, "BAD_WORDS_DICT", row))),
        bias=embedding_bias(tokenizer, bias_words, bias_weights, limits.vocab_size),
    )


def assemble(rows: list[Prepared]) -> dict[str, np.ndarray]:
    """Batch arrays: prompts right-padded with each row's pad id, word lists padded to the widest."""
    width = max(len(r.ids) for r in rows)
    input_ids = np.array([r.ids + [r.pad_id] * (width - len(r.ids)) for r in rows], dtype=np.int32)
    bias_len = max(len(r.bias) for r in rows)
    bias = np.zeros((len(rows), bias_len), dtype=np.float32)
    for i, r in enumerate(rows):
        bias[i, :len(r.bias)] = r.bias

    def column(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int32).reshape(-1, 1)

    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": column([len(r.ids) for r in rows]),
        "REQUEST_OUTPUT_LEN": column([r.output_len for r in rows]),
        "OUT_END_ID": column([r.end_id for r in rows]),
        "OUT_PAD_ID": column([r.pad_id for r in rows]),
        "STOP_WORDS_IDS": stack_word_lists([r.stop_words for r in rows]),
        "BAD_WORDS_IDS": stack_word_lists([r.bad_words for r in rows]),
        "EMBEDDING_BIAS": bias,
        # ChatGLM3 is decoder-only: one pad id, as NVIDIA's preprocessing sends without a decoder query
        "DECODER_INPUT_ID": column([r.pad_id for r in rows]),
        "REQUEST_DECODER_INPUT_LEN": column([1] * len(rows)),
    }


def embedding_bias(tokenizer: ChatGLMTokenizer, words: Sequence[str], weights: Sequence[float],
                   vocab_size: int) -> np.ndarray:
    """[vocab_size] float32 adding each word's weight to the logits of its ids ([0] when no words)."""
    if len(words) != len(weights):
        raise UsageError(f"embedding_bias_words has {len(words)} entries but embedding_bias_weights has "
                         f"{len(weights)}")
    if not words:
        return np.zeros(0, dtype=np.float32)
    bias = np.zeros(vocab_size, dtype=np.float32)
    for word, weight in zip(words, weights, strict=True):
        ids = sorted({token for seq in word_ids(tokenizer, word) for token in seq})
        bias[ids] += np.float32(weight)
    return bias


def refuse_included_input(exclude: np.ndarray | None) -> None:
    """UsageError for exclude_input_in_output false, which the ensemble routes here with NVIDIA's backend."""
    if exclude is not None and not np.asarray(exclude).astype(bool).all():
        raise UsageError("exclude_input_in_output false: with NVIDIA's tensorrtllm backend the ensemble returns the "
                         "reply only; the tensorrt_llm_bls model puts the prompt before it")


def refuse_streaming(stream: np.ndarray | None) -> None:
    """UsageError when the request asks the ensemble to stream (see the module docstring)."""
    if stream is not None and np.asarray(stream).astype(bool).any():
        raise UsageError("the ensemble returns whole replies with NVIDIA's tensorrtllm backend; stream with the "
                         "tensorrt_llm_bls model (it decodes each request's stream without splitting characters)")


# --- reading one row of a request's arrays ------------------------------------------------------


def _values(inputs: dict, name: str, row: int) -> list:
    array = inputs.get(name)
    return [] if array is None else list(np.asarray(array[row]).reshape(-1))


def _decode(value: object, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{CLIENT_NAMES[name]} is not valid UTF-8") from None
    return str(value)


def _one_text(inputs: dict, name: str, row: int) -> str:
    values = _values(inputs, name, row)
    if len(values) != 1:
        raise UsageError(f"{CLIENT_NAMES[name]} must hold one string per request, not {len(values)}")
    return _decode(values[0], name)


def _texts(inputs: dict, name: str, row: int) -> list[str]:
    return [text for text in (_decode(v, name) for v in _values(inputs, name, row)) if text]


def _words(inputs: dict, name: str, row: int) -> list[str]:
    words = _texts(inputs, name, row)
    check_words(words, CLIENT_NAMES[name])
    return words


def _floats(inputs: dict, name: str, row: int) -> list[float]:
    return [float(v) for v in _values(inputs, name, row)]


def _one_int(inputs: dict, name: str, row: int) -> int:
    values = _values(inputs, name, row)
    if len(values) != 1:
        raise UsageError(f"{CLIENT_NAMES[name]} must hold one integer per request, not {len(values)}")
    return int(values[0])


def _token_id(tokenizer: ChatGLMTokenizer, inputs: dict, name: str, row: int, default: int) -> int:
    if inputs.get(name) is None:
        return default
    token = _one_int(inputs, name, row)
    if not 0 <= token < tokenizer.vocab_size:
        raise UsageError(f"{CLIENT_NAMES[name]} {token} is not a token id (0..{tokenizer.vocab_size - 1})")
    return token


class TritonPythonModel:
    """Triton's entry point: one response per request, an error response for a bad request."""

    def initialize(self, args: dict) -> None:
        setup = triton_io.setup(args, PREPROCESSING)
        self.tokenizer, self.limits = setup.tokenizer(), Limits.from_parameters(setup.params, setup.name)
        self.dtypes = triton_io.output_dtypes(setup.config)

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            inputs = triton_io.input_arrays(request, INPUTS)
            refuse_streaming(inputs.pop("STREAM"))
            refuse_included_input(inputs.pop("EXCLUDE_INPUT_IN_OUTPUT"))
            arrays = preprocess(self.tokenizer, self.limits, inputs)
        except Exception as e:  # a bad request must not fail the others of its batch
            return triton_io.error_response(e)
        return pb_utils.InferenceResponse(output_tensors=triton_io.output_tensors(arrays, self.dtypes))
