"""An OpenAI-compatible API in front of a launched Triton server: `python -m trtglm.serve.openai_api`.

`trtglm launch` runs it beside the ranks once Triton is ready (supervise.py). It serves
`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent
events, `data: {json}` then `data: [DONE]`), with FastAPI under uvicorn.

Every answer comes from Triton over gRPC streaming (tritonclient's asyncio client), from
`ensemble` when trtglm's python backend serves tensorrt_llm (its postprocessing then streams exact
text, with no BLS instance between), else from `tensorrt_llm_bls` (with NVIDIA's backend only the
BLS model streams exact text), else from `ensemble`. The request's messages go as a JSON chat in
`text_input` (openai_protocol.py builds it; the served preprocessing applies ChatGLM3's template
with trtglm.chatglm.chat, which counts the prompt's tokens here too); a completion's prompt is one
user turn; the prompt's tokens are counted in the engine's own prompt format (ChatGLM2's for a
ChatGLM2 engine). `n` choices are `n` requests (seed + i each when a seed is given). A request's
settings go as one `SamplingConfig` and one `OutputConfig` (trtglm.request_config), which asks for
log probabilities only when the client asks (`logprobs`): trtglm's runtime sends one
`output_log_probs` value per generated token in every response (zeros unless asked), whose count is
`completion_tokens` (every generated token, the stop token that ended the reply included); NVIDIA's
engine sends them only when asked, so with it every request asks. `finish_reason` is "length" when
that count reached the token limit (max_tokens, or what the engine's max_seq_len leaves after the
prompt). Stop strings
go to the engine as stop words, and the answer is cut where the first one starts (streamed text
that may begin one is held back until it is known). With tools offered, a reply whose first line
is a tool's name is held back and, when its rest reads as the call's arguments, answered as
`tool_calls` (finish_reason "tool_calls"). Log probabilities of answers that are not streamed
pair each generated token's value with that token's text as ChatGLM3 would spell the reply
(metadata line, content, stop token); the engine gives no alternatives, so top_logprobs > 0 is
refused.

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed or
out-of-range request (bad JSON, wrong types, negative max_tokens, a prompt longer than the
engine's max_input_len), 404 for an unknown model or path, 422 for what this server understands
but cannot do, 500 when Triton fails, 503 when it is unreachable or busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trtglm.backend.contract import BLS, ENSEMBLE, PREPROCESSING, PYTHON, TOKENIZER_DIR, Limits, parameter
from trtglm.chatglm.chat import PROMPT_IDS, may_call_tool, reply_tokens, tool_call
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import PromptTooLongError, UsageError, is_busy
from trtglm.model_repository import (engine_backend, has_model, model_config, parameters, return_sequences_limit,
                                     served_name)
from trtglm.request_config import OutputConfig, SamplingConfig, check_return_sequences, client_inputs
from trtglm.serve.openai_protocol import (MAX_BODY_BYTES, ApiError, ChatRequest, CompletionRequest, Sampling,
                                          chatglm_messages, completion_messages, refuse_unsupported, wants_log_probs)

log = logging.getLogger(__name__)

GRACEFUL_S = 5  # how long a stopped server lets open answers finish (< the supervisor's grace)

HEALTH_TIMEOUT_S = 2.0
TRITON_STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503,
                 "StatusCode.RESOURCE_EXHAUSTED": 503}  # others: 500
RETRY_AFTER_S = 1  # what a 503 tells a client to wait before it asks again (Retry-After)


# --- what is served --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """The model behind the API: its id, the Triton model answering, the tokenizer, the engine's limits and prompt
    format (preprocessing's), and whether its engine is trtglm's runtime (which counts every token without log
    probabilities)."""

    model_id: str
    triton_model: str
    tokenizer_dir: str
    limits: Limits
    max_return_sequences: int  # the most choices of one prompt (n), as the served models allow
    trtglm_engine: bool = True


def served_model(repo: Path) -> Served | None:
    """What `repo` serves to the API; None when it has no client-facing model (no BLS, no ensemble)."""
    triton_model = client_model(repo)
    if triton_model is None or not has_model(repo, PREPROCESSING):
        return None
    params = parameters(model_config(repo, PREPROCESSING))
    return Served(model_id=served_name(repo), triton_model=triton_model,
                  tokenizer_dir=parameter(params, TOKENIZER_DIR, PREPROCESSING),
                  limits=Limits.from_parameters(params, PREPROCESSING),
                  max_return_sequences=return_sequences_limit(repo), trtglm_engine=engine_backend(repo) == PYTHON)


def client_model(repo: Path) -> str | None:
    """The Triton model that answers the API (see the module's doc); None when there is none."""
    present = [m for m in (ENSEMBLE, BLS) if has_model(repo, m)]
    if ENSEMBLE in present and engine_backend(repo) == PYTHON:
        return ENSEMBLE
    return BLS if BLS in present else next(iter(present), None)


# --- one generation through Triton ---------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request to Triton: a ChatGLM3 chat and its settings."""

    messages: list[dict]
    max_tokens: int
    sampling: SamplingConfig
    output: OutputConfig
    stop: tuple[str, ...]
    stream: bool


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int  # generated tokens this response carries
    log_probs: tuple[float, ...]  # theirs, when asked for


def triton_inputs(ask: Ask) -> dict[str, np.ndarray]:
    """The ensemble's / BLS model's inputs ([1, …] each)."""
    arrays = {
        "text_input": np.array([[json.dumps({"messages": ask.messages}, ensure_ascii=False).encode()]], dtype=object),
        "max_tokens": np.array([[ask.max_tokens]], dtype=np.int32),
        "stream": np.array([[ask.stream]]),
        **{name: np.array([[value]], dtype=dtype) for name, (value, dtype) in
           client_inputs(ask.sampling, ask.output).items()},
    }
    if ask.stop:
        arrays["stop_words"] = np.array([[word.encode() for word in ask.stop]], dtype=object)
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
        """Whether Triton calls the model ready now."""
        try:
            return await self.client.is_model_ready(self.model, client_timeout=HEALTH_TIMEOUT_S)
        except Exception:  # unreachable, or no answer in time
            return False

    async def pieces(self, ask: Ask) -> AsyncIterator[Piece]:
        """The reply's text pieces with their tokens' log probabilities (one piece when not streamed)."""
        tensors = []
        for name, array in triton_inputs(ask).items():
            tensor = self.grpc.InferInput(name, list(array.shape), _triton_type(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        request = {"model_name": self.model, "inputs": tensors, "enable_empty_final_response": True,
                   "outputs": [self.grpc.InferRequestedOutput(name) for name in ("text_output", "output_log_probs")]}

        async def one_request():
            yield request

        import grpc

        responses = self.client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise _triton_error(error)
                piece = _piece(result, ask.output.return_log_probs)
                if piece.text or piece.tokens:
                    yield piece
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        except grpc.RpcError as e:  # the stream broke: Triton stopped, or is unreachable
            raise ApiError(503, f"the model server failed: {e.details() or e.code()}", kind="server_error") from None
        finally:
            responses.cancel()
        raise ApiError(503, "the model server ended the stream before the reply", kind="server_error")


def _triton_type(array: np.ndarray) -> str:
    return {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL", np.float32: "FP32",
            np.uint64: "UINT64"}[array.dtype.type]


def _piece(result, asked_log_probs: bool) -> Piece:
    text = result.as_numpy("text_output")
    log_probs = result.as_numpy("output_log_probs")
    joined = b"".join(text.reshape(-1)).decode("utf-8") if text is not None else ""
    values = tuple(float(v) for v in log_probs.reshape(-1)) if log_probs is not None else ()
    return Piece(joined, len(values), values if asked_log_probs else ())


def _triton_error(error) -> ApiError:
    message = error.message() or str(error)
    # an error inside a gRPC stream carries no status code (Triton sends only its message): a full queue is told
    # by its words, whichever model refused the request
    status = 503 if is_busy(message) else TRITON_STATUS.get(str(error.status()), 500)
    if status == 400:
        code = "context_length_exceeded" if "max_input_len" in message else None
        return ApiError(400, message, code=code)
    if status == 503:
        return ApiError(503, f"the model server is busy, retry later: {message}", kind="server_error",
                        code="server_busy", retry_after=RETRY_AFTER_S)
    return ApiError(status, f"the model server failed: {message}", kind="server_error")


# --- one choice's text -----------------------------------------------------------------------------


@dataclass
class ChoiceText:
    """One choice's reply as pieces arrive: stop strings cut it, text that may begin one (or, with tools,
    a tool call) is held back; `finish` gives the rest and the tool call, if the reply is one."""

    stops: tuple[str, ...]
    tool_names: tuple[str, ...]
    limit: int
    text: str = ""
    sent: int = 0
    tokens: int = 0  # generated so far
    log_probs: list[float] = field(default_factory=list)
    stopped: bool = False

    def add(self, piece: Piece) -> str:
        """Text that can be sent now."""
        if self.stopped:
            return ""
        self.tokens += piece.tokens
        self.log_probs += piece.log_probs
        self.text += piece.text
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
        if self.tool_names and may_call_tool(self.text, self.tool_names):
            return ""
        ready = len(self.text) if self.stopped else len(self.text) - _held_back(self.text, self.stops)
        out, self.sent = self.text[self.sent:ready], max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, dict | None]:
        """(text not sent yet, the tool call {"name", "parameters"} or None)."""
        call = tool_call(self.text) if self.tool_names and not self.stopped else None
        if call is not None and call["name"] in self.tool_names:
            return "", call
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, None

    def finish_reason(self, call: dict | None) -> str:
        if call is not None:
            return "tool_calls"
        return "length" if not self.stopped and self.tokens >= self.limit else "stop"


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


# --- the API ---------------------------------------------------------------------------------------


class Api:
    """The endpoints' work, apart from HTTP."""

    def __init__(self, served: Served, triton: Triton, tokenizer: ChatGLMTokenizer):
        self.served, self.triton, self.tokenizer = served, triton, tokenizer

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served.model_id, "object": "model", "created": 0,
                                            "owned_by": "trtglm"}]}

    def check_counts(self, request: ChatRequest | CompletionRequest) -> None:
        """400 for more choices of one prompt than the served models allow (before any work)."""
        counts = {"n": request.n, "best_of": getattr(request, "best_of", None)}
        for name, count in counts.items():
            try:
                check_return_sequences(count or 1, self.served.max_return_sequences, name)
            except UsageError as e:
                raise ApiError(400, str(e), name, "invalid_value") from None
        request.check_stop_bytes()

    def check_model(self, request: Sampling) -> None:
        if request.model != self.served.model_id:
            raise ApiError(404, f"the model {request.model!r} does not exist; this server serves "
                                f"{self.served.model_id!r}", "model", "model_not_found")

    def prompt_length(self, messages: list[dict], param: str) -> int:
        """The prompt's token count, as the served preprocessing will count it; 400 when it does not fit."""
        limits = self.served.limits
        try:
            limits.check_prompt_bytes(len(json.dumps(messages, ensure_ascii=False).encode()),
                                      self.tokenizer.longest_piece_bytes)
            count = len(PROMPT_IDS[limits.chatglm_version](self.tokenizer, messages))
            limits.check_prompt_tokens(count)
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param, "context_length_exceeded") from None
        except UsageError as e:
            raise ApiError(400, str(e), param) from None
        return count

    def token_limit(self, requested: int | None, prompt_tokens: int) -> int:
        room = self.served.limits.max_seq_len - prompt_tokens
        if room < 1:
            raise ApiError(400, f"the prompt ({prompt_tokens} tokens) leaves no room for an answer within the "
                                f"engine's max_seq_len ({self.served.limits.max_seq_len})", "messages",
                           "context_length_exceeded")
        return min(requested, room) if requested is not None else room

    def asks(self, request: ChatRequest | CompletionRequest, messages: list[dict], limit: int) -> list[Ask]:
        output = OutputConfig(return_log_probs=wants_log_probs(request) or not self.served.trtglm_engine)
        return [Ask(messages, limit, request.sampling_config(i), output, tuple(request.stop_words()), request.stream)
                for i in range(request.n)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _tool_calls(call: dict, streamed: bool) -> list[dict]:
    entry = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["parameters"], ensure_ascii=False)}}
    return [{"index": 0, **entry} if streamed else entry]


def token_log_probs(tokenizer: ChatGLMTokenizer, text: str, call: dict | None,
                    values: list[float]) -> list[tuple[str, float]]:
    """(token text, log prob) per generated token: the reply's tokens as ChatGLM3 writes its turn, paired with the
    engine's values in order ("" past them)."""
    tokens = reply_tokens(tokenizer, text, call is not None)
    return [(tokens[i] if i < len(tokens) else "", value) for i, value in enumerate(values)]


# --- one request's answer --------------------------------------------------------------------------


class Answering:
    """What chat and completion requests share: the answer of every choice, whole or as chunks, with usage.
    Subclasses check the request and make its asks (`prepare`), and answer or stream one choice."""

    PREFIX, OBJECT, CHUNK_OBJECT = "", "", ""

    def __init__(self, api: Api, request: ChatRequest | CompletionRequest):
        self.api, self.request = api, request
        self.id, self.created = f"{self.PREFIX}-{secrets.token_hex(12)}", int(time.time())
        self.prompt_tokens = 0

    def prepare(self) -> list[Ask]:
        raise NotImplementedError

    async def choice(self, index: int, ask: Ask) -> tuple[dict, int]:
        """One choice and its completion tokens."""
        raise NotImplementedError

    def choice_chunks(self, index: int, ask: Ask, counts: list[int]) -> AsyncIterator[dict]:
        """One choice's chunks, its completion tokens kept in counts[index]."""
        raise NotImplementedError

    async def answer(self, asks: list[Ask]) -> dict:
        choices = await asyncio.gather(*(self.choice(i, ask) for i, ask in enumerate(asks)))
        completion = sum(count for _, count in choices)
        return {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.request.model,
                "choices": [choice for choice, _ in choices], "usage": _usage(self.prompt_tokens, completion)}

    async def chunks(self, asks: list[Ask]) -> AsyncIterator[dict]:
        counts = [0] * len(asks)
        async for chunk in _merged([self.choice_chunks(i, ask, counts) for i, ask in enumerate(asks)]):
            yield chunk
        if self.request.include_usage():
            yield self.chunk([], usage=_usage(self.prompt_tokens, sum(counts)))

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.request.model,
                 "choices": choices}
        if self.request.include_usage():
            chunk["usage"] = usage
        return chunk

    async def replies(self, reply: ChoiceText, ask: Ask, counts: list[int], index: int) -> AsyncIterator[str]:
        """The text of one choice that can be sent, as pieces arrive."""
        async for piece in self.api.triton.pieces(ask):
            text = reply.add(piece)
            counts[index] = reply.tokens
            if text:
                yield text


class Chat(Answering):
    """One chat completion request."""

    PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def prepare(self) -> list[Ask]:
        self.api.check_model(self.request)
        self.api.check_counts(self.request)
        refuse_unsupported(self.request)
        messages = chatglm_messages(self.request)
        self.prompt_tokens = self.api.prompt_length(messages, "messages")
        self.limit = self.api.token_limit(self.request.token_limit(), self.prompt_tokens)
        return self.api.asks(self.request, messages, self.limit)

    def choice_text(self) -> ChoiceText:
        names = tuple(function.name for function in self.request.offered_tools())
        return ChoiceText(tuple(self.request.stop_words()), names, self.limit)

    async def choice(self, index: int, ask: Ask) -> tuple[dict, int]:
        reply = self.choice_text()
        async for _ in self.replies(reply, ask, [0], 0):
            pass
        _, call = reply.finish()
        message = {"role": "assistant", "content": None if call else reply.text}
        if call:
            message["tool_calls"] = _tool_calls(call, streamed=False)
        choice = {"index": index, "message": message, "logprobs": None, "finish_reason": reply.finish_reason(call)}
        if self.request.logprobs:
            pairs = token_log_probs(self.api.tokenizer, reply.text, call, reply.log_probs)
            choice["logprobs"] = {"content": [{"token": token, "logprob": value, "bytes": list(token.encode()),
                                               "top_logprobs": []} for token, value in pairs]}
        return choice, reply.tokens

    async def choice_chunks(self, index: int, ask: Ask, counts: list[int]) -> AsyncIterator[dict]:
        # the role comes with the first text, so that a request Triton refuses (busy) fails before any chunk
        role = self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        reply = self.choice_text()
        async for text in self.replies(reply, ask, counts, index):
            if role:
                yield role
                role = None
            yield self.chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
        if role:
            yield role
        text, call = reply.finish()
        if call:
            yield self.chunk([{"index": index, "delta": {"tool_calls": _tool_calls(call, streamed=True)},
                               "finish_reason": None}])
        elif text:
            yield self.chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
        yield self.chunk([{"index": index, "delta": {}, "finish_reason": reply.finish_reason(call)}])


class Completion(Answering):
    """One completion request: each prompt (one user turn) answered `n` times."""

    PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def prepare(self) -> list[Ask]:
        self.api.check_model(self.request)
        self.api.check_counts(self.request)
        refuse_unsupported(self.request)
        asks, self.limits = [], []
        for prompt in self.request.prompts():
            messages = completion_messages(prompt)
            count = self.api.prompt_length(messages, "prompt")
            limit = self.api.token_limit(self.request.max_tokens, count)
            self.prompt_tokens += count
            self.limits += [limit] * self.request.n
            asks += self.api.asks(self.request, messages, limit)
        return asks

    def choice_text(self, index: int) -> ChoiceText:
        return ChoiceText(tuple(self.request.stop_words()), (), self.limits[index])

    async def choice(self, index: int, ask: Ask) -> tuple[dict, int]:
        reply = self.choice_text(index)
        async for _ in self.replies(reply, ask, [0], 0):
            pass
        reply.finish()
        choice = {"index": index, "text": reply.text, "logprobs": None, "finish_reason": reply.finish_reason(None)}
        if self.request.logprobs is not None:
            pairs = token_log_probs(self.api.tokenizer, reply.text, None, reply.log_probs)
            offsets = np.cumsum([0] + [len(token) for token, _ in pairs[:-1]]).tolist()
            choice["logprobs"] = {"tokens": [t for t, _ in pairs], "token_logprobs": [v for _, v in pairs],
                                  "top_logprobs": None, "text_offset": offsets}
        return choice, reply.tokens

    async def choice_chunks(self, index: int, ask: Ask, counts: list[int]) -> AsyncIterator[dict]:
        reply = self.choice_text(index)
        async for text in self.replies(reply, ask, counts, index):
            yield self.chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
        text, _ = reply.finish()
        yield self.chunk([{"index": index, "text": text, "logprobs": None,
                           "finish_reason": reply.finish_reason(None)}])


async def _merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of several async iterators as they come; the first error ends all of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        finished = 0
        while finished < len(tasks):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is done:
                finished += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


# --- HTTP ------------------------------------------------------------------------------------------


def create_app(api: Api):
    """The FastAPI application over `api`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="trtglm OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError):
        return error_response(validation_error(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException):
        code = "not_found" if error.status_code == 404 else None
        return error_response(ApiError(error.status_code, str(error.detail), code=code))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, error: Exception):
        log.error("unexpected error", exc_info=error)
        return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error"))

    @app.get("/health")
    async def health():
        """200 while the model it asks answers readiness (a launch whose process died stops serving)."""
        if not await api.triton.ready():
            raise ApiError(503, f"the model server does not serve {api.triton.model}", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return api.models()

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        card = next((card for card in api.models()["data"] if card["id"] == model_id), None)
        if card is None:
            raise ApiError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return card

    async def respond(http: Request, kind: type[ChatRequest | CompletionRequest], answering: type[Answering]):
        """Read (bounded), parse and prepare off the event loop, then answer; a stream's first chunk is awaited
        before the response starts, so that a request Triton refuses gets its HTTP status (503 when busy)."""
        body = await bounded_body(http)
        try:
            request = await asyncio.to_thread(kind.model_validate_json, body)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        work = answering(api, request)
        asks = await asyncio.to_thread(work.prepare)
        if not request.stream:
            return JSONResponse(await work.answer(asks))
        chunks = work.chunks(asks)
        first = await anext(chunks, None)
        return StreamingResponse(sse(_after(first, chunks)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def chat(http: Request):
        return await respond(http, ChatRequest, Chat)

    async def completions(http: Request):
        return await respond(http, CompletionRequest, Completion)

    # plain routes: the handlers read the body themselves (bounded, parsed off the event loop)
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    return app


async def bounded_body(http) -> bytes:
    """The request's body; 413 past MAX_BODY_BYTES, told by Content-Length or while it arrives."""
    too_large = ApiError(413, f"the request body is larger than this server takes ({MAX_BODY_BYTES:,} bytes)",
                         code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for part in http.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


async def _after(first: dict | None, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


def validation_error(errors: list[dict]) -> ApiError:
    """The first of pydantic's complaints as a 400 naming the field; of a union's, the member of the value's
    own type (a list of too many prompts: its length, not that it is no string)."""
    first = errors[0] if errors else {}
    location = _field(first)
    first = next((e for e in errors if _field(e) == location and not e.get("type", "").endswith("_type")), first)
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
                        code="invalid_json")
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return ApiError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def _field(error: dict) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if part != "body" and not _union_tag(part)]


def _union_tag(part) -> bool:
    """Whether a part of pydantic's error location names a member of a union (`str`, `list[str]`, a model)."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"} or part[:1].isupper()
                                      or part.startswith("constrained-"))


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events as the openai SDK reads them; an error after the first chunk is sent as an event."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
    except ApiError as e:
        yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n".encode()
    except Exception as e:  # the response has started: the client learns of it in the stream
        log.error("unexpected error while streaming", exc_info=e)
        body = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body()
        yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"


# --- the process -----------------------------------------------------------------------------------


def serve(repo: Path, grpc_url: str, host: str, port: int) -> None:
    import uvicorn

    served = served_model(repo)
    if served is None:
        raise UsageError(f"{repo}: no {BLS} or {ENSEMBLE} model with preprocessing to answer the OpenAI API")
    tokenizer = ChatGLMTokenizer(served.tokenizer_dir)
    api = Api(served, Triton(grpc_url, served.triton_model), tokenizer)
    log.info("OpenAI API for %s (%s over %s) on %s:%d", served.model_id, served.triton_model, grpc_url, host, port)
    uvicorn.run(create_app(api), host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_S)


def main(argv: list[str] | None = None) -> None:
    """`python -m trtglm.serve.openai_api --repo REPO --grpc HOST:PORT --host H --port P [--launch SHM_BASE]`
    (--launch only marks the process as the launch's, for the supervisor and stale-launch cleanup)."""
    parser = argparse.ArgumentParser(prog="trtglm.serve.openai_api")
    parser.add_argument("--repo", required=True)
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8003)
    parser.add_argument("--launch", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(Path(args.repo), args.grpc, args.host, args.port)
    except UsageError as e:
        print(f"trtglm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
