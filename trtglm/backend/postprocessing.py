"""ChatGLM3 postprocessing: the engine's output ids -> reply text, whole or as exact streamed pieces.

Inputs TOKENS_BATCH [batch, beams, ids] and SEQUENCE_LENGTH [batch, beams]; output OUTPUT, one
flat entry per row and beam ([batch x beams], as NVIDIA's postprocessing gives it). Without
GENERATED_IDS each sequence is a whole reply: `chat.reply_text` (up to the first stop id,
decoded as a whole so spaces and characters are intact, stripped). With GENERATED_IDS
[batch, beams, ids] (every id generated so far) and IS_FINAL [batch, 1] (no more responses
follow), which trtglm's runtime sends to the ensemble, TOKENS_BATCH holds only the
response's new ids and each OUTPUT is `chat.reply_piece`: the text those ids add, so a
streamed reply's pieces join to exactly its whole text (negative ids are the padding of rows
shorter than a batch's longest, and are dropped). Where a layout declares
OUT_CUM_LOG_PROBS / OUT_OUTPUT_LOG_PROBS (NVIDIA's v0.7.1), they pass CUM_LOG_PROBS /
OUTPUT_LOG_PROBS through.

REPLY_PREFIX [batch, 1] (trtglm's runtime sends it) goes before each of that row's texts: the
request's text_input when its exclude_input_in_output is false and it is not streamed
(`reply_prefixes`, which the BLS model applies too), else empty.

In an ensemble Triton lets this model read only the engine's outputs, so without GENERATED_IDS
a streamed response would arrive as a handful of new ids with nothing to say which request
they continue, and no decoder could then keep SentencePiece spaces or characters split over
responses. NVIDIA's tensorrtllm backend sends nothing more, so with it the ensemble does not
stream (preprocessing refuses `stream`; tensorrt_llm_bls streams, see `bls.py`).
"""

from __future__ import annotations

import numpy as np

from trtglm.backend import triton_io
from trtglm.backend.contract import CONTRACT, POSTPROCESSING, names
from trtglm.backend.triton_io import pb_utils
from trtglm.chatglm.chat import reply_piece, reply_text
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError

PASS_THROUGH = {"OUT_CUM_LOG_PROBS": "CUM_LOG_PROBS", "OUT_OUTPUT_LOG_PROBS": "OUTPUT_LOG_PROBS"}  # NVIDIA v0.7.1
INPUTS = names(CONTRACT[POSTPROCESSING].inputs) + tuple(PASS_THROUGH.values())


def reply_prefixes(text: np.ndarray | None, exclude: np.ndarray | None, streaming: bool, rows: int) -> np.ndarray:
    """Per row [rows, 1]: the request's text when exclude_input_in_output is false (absent: true, as
    tensorrt_llm's parameter of that name is in trtglm's repositories) and the reply is not streamed, else b""."""
    flags = [True] * rows if exclude is None else [bool(f) for f in _per_row(exclude, rows, "exclude_input_in_output")]
    if streaming or all(flags):
        return np.full((rows, 1), b"", dtype=np.object_)
    if text is None:
        raise UsageError("exclude_input_in_output false needs the request's text")
    texts = _per_row(text, rows, "text_input")
    return np.array([[_utf8(t) if not excluded else b""] for t, excluded in zip(texts, flags)], dtype=np.object_)


def _per_row(array: np.ndarray, rows: int, name: str) -> np.ndarray:
    values = np.asarray(array).reshape(-1)
    if values.size != rows:
        raise UsageError(f"{name} must hold one value for each of the {rows} sequences, not {values.size}")
    return values


def flat_texts(texts: list[list[str]], prefixes: np.ndarray | None = None) -> np.ndarray:
    """The texts [batch][beams] as one flat BYTES array [batch x beams], each after its row's prefix."""
    heads = [b""] * len(texts) if prefixes is None else [
        _utf8(prefix) for prefix in np.asarray(prefixes).reshape(len(texts), -1)[:, 0]]
    return np.array([head + text.encode("utf-8") for row, head in zip(texts, heads) for text in row],
                    dtype=np.object_)


def _utf8(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def postprocess(tokenizer: ChatGLMTokenizer, tokens: np.ndarray | None, lengths: np.ndarray | None,
                generated: np.ndarray | None = None, final: np.ndarray | None = None) -> list[list[str]]:
    """Reply text (whole, or this response's piece when `generated` is given) per batch row and beam."""
    if tokens is None or lengths is None or tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
        raise UsageError("postprocessing needs TOKENS_BATCH [batch, beams, ids] and SEQUENCE_LENGTH [batch, beams]")
    rows, beams = range(tokens.shape[0]), range(tokens.shape[1])
    if generated is None:
        return [[reply_text(tokenizer, tokens[row, beam, :max(0, min(int(lengths[row, beam]), tokens.shape[2]))])
                 for beam in beams] for row in rows]
    if generated.ndim != 3 or generated.shape[:2] != tokens.shape[:2] or final is None \
            or np.asarray(final).reshape(len(rows), -1).shape[1] != 1:
        raise UsageError("postprocessing needs GENERATED_IDS [batch, beams, ids] and IS_FINAL [batch, 1] together")
    done = np.asarray(final).reshape(-1)
    return [[reply_piece(tokenizer, [i for i in generated[row, beam].tolist() if i >= 0], int(lengths[row, beam]),
                         bool(done[row])) for beam in beams] for row in rows]


class TritonPythonModel:
    """Triton's entry point: one response per request."""

    def initialize(self, args: dict) -> None:
        setup = triton_io.setup(args, POSTPROCESSING)
        self.tokenizer, self.dtypes = setup.tokenizer(), triton_io.output_dtypes(setup.config)

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            inputs = triton_io.input_arrays(request, INPUTS)
            texts = postprocess(self.tokenizer, inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"],
                                inputs["GENERATED_IDS"], inputs["IS_FINAL"])
            output = flat_texts(texts, inputs["REPLY_PREFIX"])
        except Exception as e:  # one bad request must not fail the others of its batch
            return triton_io.error_response(e)
        arrays = {"OUTPUT": output}
        arrays.update({out: inputs[src] for out, src in PASS_THROUGH.items() if inputs.get(src) is not None})
        return pb_utils.InferenceResponse(output_tensors=triton_io.output_tensors(arrays, self.dtypes))
