"""ChatGLM3 postprocessing: the engine's output ids -> reply text, one whole sequence at a time.

Inputs TOKENS_BATCH [batch, beams, ids] and SEQUENCE_LENGTH [batch, beams]; output OUTPUT
[batch, beams], each sequence's `reply.reply_text` (up to the first stop id, blank metadata
line dropped, decoded as a whole so spaces and characters are intact). Where a layout
declares OUT_CUM_LOG_PROBS / OUT_OUTPUT_LOG_PROBS (NVIDIA's v0.7.1), they pass
CUM_LOG_PROBS / OUTPUT_LOG_PROBS through.

Sequences are always whole: the ensemble does not stream (preprocessing refuses `stream`).
In an ensemble Triton lets this model read only the engine's outputs, so a streamed response
would arrive as a handful of new ids with nothing to say which request they continue, and no
decoder can then keep SentencePiece spaces or characters split over responses. Streaming is
served by tensorrt_llm_bls, which sees each request's whole stream (`bls.py`).
"""

from __future__ import annotations

import numpy as np

from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.repo.python_models import triton_io
from trtglm.repo.python_models.reply import reply_text
from trtglm.repo.python_models.triton_io import pb_utils

INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH", "CUM_LOG_PROBS", "OUTPUT_LOG_PROBS")
PASS_THROUGH = {"OUT_CUM_LOG_PROBS": "CUM_LOG_PROBS", "OUT_OUTPUT_LOG_PROBS": "OUTPUT_LOG_PROBS"}


def postprocess(tokenizer: ChatGLMTokenizer, tokens: np.ndarray | None, lengths: np.ndarray | None) -> list[list[str]]:
    """Reply text per batch row and beam."""
    if tokens is None or lengths is None or tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
        raise UsageError("postprocessing needs TOKENS_BATCH [batch, beams, ids] and SEQUENCE_LENGTH [batch, beams]")
    return [[reply_text(tokenizer, tokens[row, beam, :max(0, min(int(lengths[row, beam]), tokens.shape[2]))])
             for beam in range(tokens.shape[1])] for row in range(tokens.shape[0])]


class TritonPythonModel:
    """Triton's entry point: one response per request."""

    def initialize(self, args: dict) -> None:
        config = triton_io.model_config(args)
        params, name = triton_io.parameters(config), config.get("name", "postprocessing")
        self.tokenizer = ChatGLMTokenizer(triton_io.parameter(params, "tokenizer_dir", name))
        self.dtypes = triton_io.output_dtypes(config)

    def execute(self, requests: list) -> list:
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            inputs = triton_io.input_arrays(request, INPUTS)
            texts = postprocess(self.tokenizer, inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"])
        except Exception as e:  # one bad request must not fail the others of its batch
            return triton_io.error_response(e)
        arrays = {"OUTPUT": triton_io.strings(texts)}
        arrays.update({out: inputs[src] for out, src in PASS_THROUGH.items() if inputs.get(src) is not None})
        return pb_utils.InferenceResponse(output_tensors=triton_io.output_tensors(arrays, self.dtypes))
