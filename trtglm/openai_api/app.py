"""The API's HTTP server: `python -m trtglm.openai_api --repo REPO --grpc HOST:PORT [--host H] [--port P]
[--metrics URL] [--graceful S]`.

`trtglm launch` runs it beside the ranks once Triton is ready (serve/supervise.py, serve/openai_process.py). It
serves `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` and
`POST /v1/completions` (streamed as server-sent events: streaming.py), with FastAPI under uvicorn. A request's
body is read bounded and parsed off the event loop; errors are OpenAI's (errors.py). `GET /metrics` answers the
API's own metrics and, with `--metrics URL`, Triton's read from that URL beside them (metrics.py).
A stopped server takes no new connection and lets the answers under way finish for `--graceful` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from pathlib import Path

from trtglm.backend.contract import BLS, ENSEMBLE
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import TrtglmError, UsageError
from trtglm.openai_api.answers import Answering, Api, Chat, Completion
from trtglm.openai_api.errors import ApiError, validation_error
from trtglm.openai_api.metrics import PROMETHEUS_TEXT, MetricsPage
from trtglm.openai_api.protocol import MAX_BODY_BYTES, ChatRequest, CompletionRequest
from trtglm.openai_api.served import served_model
from trtglm.openai_api.streaming import after, sse
from trtglm.openai_api.triton import Triton
from trtglm.ports import OPENAI_PORT
from trtglm.processes import NOT_READY_SIGNAL

log = logging.getLogger(__name__)

GRACEFUL_S = 5  # how long a stopped server lets open answers finish, unless told (< the supervisor's grace)
NOT_READY = threading.Event()  # set by NOT_READY_SIGNAL: the launch stops, /health answers 503 without asking Triton


def create_app(api: Api, metrics_url: str | None = None):
    """The FastAPI application over `api` (and Triton's metrics at `metrics_url` on its /metrics, when given)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
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
        """200 while the model it asks answers readiness (a launch whose process died stops serving) and the
        launch has not said it stops (NOT_READY_SIGNAL)."""
        if NOT_READY.is_set() or not await api.triton.ready():
            raise ApiError(503, f"the model server does not serve {api.triton.model}", kind="server_error")
        return {"status": "ok"}

    page = MetricsPage(api.admission, metrics_url)

    @app.get("/metrics")
    async def metrics():
        """Prometheus's text: the API's line (admission.py) and Triton's metrics beside it (metrics.py)."""
        return PlainTextResponse(await asyncio.to_thread(page.text), media_type=PROMETHEUS_TEXT)

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
        work.admit(asks)
        if not request.stream:
            return JSONResponse(await work.answer(asks))
        chunks = work.chunks(asks)
        first = await anext(chunks, None)
        return StreamingResponse(sse(after(first, chunks)), media_type="text/event-stream",
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


def serve(repo: Path, grpc_url: str, host: str, port: int, metrics_url: str | None = None,
          graceful_s: float = GRACEFUL_S) -> None:
    import uvicorn

    served = served_model(repo)
    if served is None:
        raise UsageError(f"{repo}: no {BLS} or {ENSEMBLE} model with preprocessing to answer the OpenAI API")
    tokenizer = ChatGLMTokenizer(served.tokenizer_dir)
    api = Api(served, Triton(grpc_url, served.triton_model), tokenizer)
    log.info("OpenAI API for %s (%s over %s) on %s:%d", served.model_id, served.triton_model, grpc_url, host, port)
    signal.signal(NOT_READY_SIGNAL, lambda *_: NOT_READY.set())
    uvicorn.run(create_app(api, metrics_url), host=host, port=port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=graceful_s)


def main(argv: list[str] | None = None) -> None:
    """`python -m trtglm.openai_api --repo REPO --grpc HOST:PORT --host H --port P [--metrics URL] [--graceful S]
    [--launch SHM_BASE]` (--launch only marks the process as the launch's, for the supervisor and stale-launch
    cleanup)."""
    parser = argparse.ArgumentParser(prog=__package__)  # python -m runs the package
    parser.add_argument("--repo", required=True)
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=OPENAI_PORT)
    parser.add_argument("--metrics", default=None)
    parser.add_argument("--graceful", type=float, default=GRACEFUL_S)
    parser.add_argument("--launch", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(Path(args.repo), args.grpc, args.host, args.port, args.metrics, args.graceful)
    except TrtglmError as e:  # a repository it cannot serve: one line, as the CLI says it
        print(f"trtglm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
