"""The API's client of Triton: one ChatGLM3 chat and its settings (`Ask`) as the ensemble's or the BLS model's
inputs, sent over gRPC streaming (tritonclient's asyncio client), its responses read back as text pieces with
their tokens' log probabilities (`Piece`), and Triton's errors as the API's.

trtglm's runtime reports a reply's generated tokens so far (`num_output_tokens`, the stop token that ended it
included) and, on its last response, why it ended (`finish_reason`: stop or length); asked for them (`Ask.reported`)
it is taken at its word. NVIDIA's engine reports neither: its tokens are counted by their `output_log_probs`
values (one per token; answers.py then always asks for them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from trtglm.backend.contract import MAX_INPUT_LEN
from trtglm.chatglm.chat import chat_text
from trtglm.errors import is_busy
from trtglm.openai_api.errors import ApiError
from trtglm.request_config import OutputConfig, SamplingConfig, client_inputs

HEALTH_TIMEOUT_S = 2.0
END_S = 5.0  # for Triton to end the stream of a complete request
TRITON_STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503,
                 "StatusCode.RESOURCE_EXHAUSTED": 503}  # others: 500
RETRY_AFTER_S = 1  # what a 503 tells a client to wait before it asks again (Retry-After)
OUTPUTS, REPORTED = ("text_output", "output_log_probs"), ("num_output_tokens", "finish_reason")


@dataclass(frozen=True)
class Ask:
    """One request to Triton: a ChatGLM3 chat and its settings."""

    messages: list[dict]
    max_tokens: int
    sampling: SamplingConfig
    output: OutputConfig
    stop: tuple[str, ...]
    stream: bool
    reported: bool = False  # the engine reports the tokens so far and why the reply ended (trtglm's runtime)


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int  # generated tokens this response carries
    log_probs: tuple[float, ...]  # theirs, when asked for
    tokens_so_far: int | None = None  # the reply's, as the engine reports them
    finish_reason: str = ""  # why the reply ended, as the engine reports it on its last response


def triton_inputs(ask: Ask) -> dict[str, np.ndarray]:
    """The ensemble's / BLS model's inputs ([1, …] each)."""
    arrays = {
        "text_input": np.array([[chat_text(ask.messages).encode()]], dtype=object),
        "stream": np.array([[ask.stream]]),
        **{name: np.array([[value]], dtype=dtype) for name, (value, dtype) in
           client_inputs(ask.sampling, ask.output, ask.max_tokens).items()},
    }
    if ask.stop:
        arrays["stop_words"] = np.array([[word.encode() for word in ask.stop]], dtype=object)
    if ask.reported:
        arrays["return_num_output_tokens"] = np.array([[True]])
    return arrays


class Triton:
    """Answers over gRPC streaming from one Triton model."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc.aio as grpc

        self.grpc, self.model, self.url = grpc, model, url
        self._client = None

    @property
    def client(self):
        """The gRPC client, made in the serving event loop (grpc.aio binds a client to the loop that made it)."""
        if self._client is None:
            self._client = self.grpc.InferenceServerClient(self.url)
        return self._client

    async def ready(self) -> bool:
        """Whether Triton calls itself ready (as its /v2/health/ready: every model loaded, not stopping) and the
        model ready now."""
        try:
            return (await self.client.is_server_ready(client_timeout=HEALTH_TIMEOUT_S)
                    and await self.client.is_model_ready(self.model, client_timeout=HEALTH_TIMEOUT_S))
        except Exception:  # unreachable, or no answer in time
            return False

    async def pieces(self, ask: Ask) -> AsyncIterator[Piece]:
        """The reply's text pieces with their tokens' log probabilities (one piece when not streamed)."""
        tensors = []
        for name, array in triton_inputs(ask).items():
            tensor = self.grpc.InferInput(name, list(array.shape), _triton_type(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        outputs = OUTPUTS + (REPORTED if ask.reported else ())
        request = {"model_name": self.model, "inputs": tensors, "enable_empty_final_response": True,
                   "outputs": [self.grpc.InferRequestedOutput(name) for name in outputs]}

        async def one_request():
            yield request

        import grpc

        responses = self.client.stream_infer(one_request())
        complete = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise api_error_of(error)
                piece = _piece(result, ask.output.return_log_probs)
                if piece.text or piece.tokens:
                    yield piece
                if result.get_response().parameters["triton_final_response"].bool_param:
                    complete = True
                    break
        except grpc.RpcError as e:  # the stream broke: Triton stopped, or is unreachable
            raise ApiError(503, f"the model server failed: {e.details() or e.code()}", kind="server_error") from None
        finally:
            if not complete:  # an abandoned reply: its request is cancelled
                responses.cancel()
        if not complete:
            raise ApiError(503, "the model server ended the stream before the reply", kind="server_error")
        await _stream_end(responses)


async def _stream_end(responses) -> None:
    """Wait for Triton to end a stream whose request is complete, cancelling it only if that takes longer than
    END_S. A complete request's stream is not cancelled: Triton 2.51 can abort when a cancellation meets a
    request's last response (docs/troubleshooting.md, "gRPC streams cancelled in bursts")."""
    import grpc

    async def read_to_end() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(read_to_end(), END_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        responses.cancel()


def _triton_type(array: np.ndarray) -> str:
    return {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL", np.float32: "FP32",
            np.uint64: "UINT64"}[array.dtype.type]


def _piece(result, asked_log_probs: bool) -> Piece:
    text, log_probs = result.as_numpy("text_output"), result.as_numpy("output_log_probs")
    so_far, reason = result.as_numpy("num_output_tokens"), result.as_numpy("finish_reason")
    joined = b"".join(text.reshape(-1)).decode("utf-8") if text is not None else ""
    values = tuple(float(v) for v in log_probs.reshape(-1)) if log_probs is not None else ()
    return Piece(joined, len(values), values if asked_log_probs else (),
                 int(so_far.reshape(-1)[0]) if so_far is not None and so_far.size else None,
                 reason.reshape(-1)[0].decode() if reason is not None and reason.size else "")


def api_error_of(error) -> ApiError:
    """A Triton error as the API answers it (see TRITON_STATUS; a full queue is 503 with Retry-After)."""
    message = error.message() or str(error)
    # an error inside a gRPC stream carries no status code (Triton sends only its message): a full queue is told
    # by its words, whichever model refused the request
    status = 503 if is_busy(message) else TRITON_STATUS.get(str(error.status()), 500)
    if status == 400:
        code = "context_length_exceeded" if MAX_INPUT_LEN in message else None
        return ApiError(400, message, code=code)
    if status == 503:
        return ApiError(503, f"the model server is busy, retry later: {message}", kind="server_error",
                        code="server_busy", retry_after=RETRY_AFTER_S)
    return ApiError(status, f"the model server failed: {message}", kind="server_error")
