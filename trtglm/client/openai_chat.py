"""The OpenAI chat API as `trtglm chat --openai` speaks it, over plain HTTP (http.py's Server, no SDK).

The API's base URL is `http://HOST:PORT/v1` (`/v1` is added to a URL without a path). Each turn is
`POST {base}/chat/completions` with the whole conversation as `messages` and `stream: true`; the answer
is server-sent events, `data: {chunk}` … `data: [DONE]`, and each chunk's `choices[0].delta.content` is
a piece of the reply. Without a model id, `GET {base}/models` must list exactly one. Errors are the API's
`{"error": {"message", …}}`: the body of a 4xx/5xx answer, or an event once the stream has begun.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from trtglm.client import ServerError, one_line, split_url
from trtglm.client.http import Server, event_lines, json_object, read_body, sse_data
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

FLAG, WHAT = "--openai", "the OpenAI API"
DONE = "[DONE]"


@dataclass(frozen=True)
class Endpoint:
    server: Server
    base: str  # the path the API's paths follow, e.g. /v1

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        if not isinstance(url, str) or not url:
            raise UsageError(f"{FLAG} must be http://HOST:PORT/v1, not {url!r}")
        parts = split_url(url, FLAG, "http://HOST:PORT/v1")
        try:
            server = Server.parse(f"{parts.scheme}://{parts.netloc}", FLAG, WHAT)
        except UsageError:
            server = None
        if server is None or parts.query or parts.fragment:
            raise UsageError(f"{FLAG} {url}: expected http://HOST:PORT/v1")
        return cls(server, parts.path.rstrip("/") or "/v1")

    def get(self, path: str, timeout: float) -> dict:
        with self.server.request("GET", self.base + path, None, timeout) as response:
            body = read_body(self.server, response)
        if response.status != 200:
            raise ServerError(api_error(f"GET {self.base}{path}", response.status, body))
        return json_object(f"GET {self.base}{path}", body)


class OpenAIChat:
    """Replies to whole conversations from an OpenAI-compatible server, streamed."""

    def __init__(self, url: str, model: str | None, max_tokens: int, temperature: float, top_p: float | None,
                 seed: int | None, timeout: float):
        self.endpoint, self.timeout = Endpoint.parse(url), timeout
        self.model = model if model is not None else listed_model(self.endpoint, timeout)
        options = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
        self.options = {name: value for name, value in options.items() if value is not None}

    def pieces(self, messages: Sequence[dict]) -> Iterator[str]:
        body = {"model": self.model, "messages": list(messages), "stream": True, **self.options}
        return chat_stream(self.endpoint, body, self.timeout)


def listed_model(endpoint: Endpoint, timeout: float) -> str:
    """The id of the one model `GET /models` lists."""
    listed = endpoint.get("/models", timeout).get("data")
    ids = [card.get("id") for card in listed if isinstance(card, dict)] if isinstance(listed, list) else []
    if len(ids) != 1 or not isinstance(ids[0], str):
        raise ServerError(f"{WHAT} at {endpoint.server.url}{endpoint.base} lists the models {ids}: "
                          "name one with --model")
    return ids[0]


def chat_stream(endpoint: Endpoint, body: dict, timeout: float) -> Iterator[str]:
    """The reply's text pieces as the chunks of a streamed chat completion bring them."""
    server, path = endpoint.server, f"{endpoint.base}/chat/completions"
    log.debug("POST %s%s", server.url, path)
    with server.request("POST", path, json.dumps(body, ensure_ascii=False).encode("utf-8"), timeout) as response:
        if response.status != 200:
            raise ServerError(api_error(path, response.status, read_body(server, response)))
        for data in sse_data(event_lines(server, response)):
            if data.strip() == DONE:
                return
            piece = delta_text(json_object(path, data.encode("utf-8")))
            if piece:
                yield piece
    raise ServerError(f"the event stream from {server.url} ended without {DONE}")


def delta_text(chunk: dict) -> str:
    """The first choice's new text in one chunk (a chunk may carry none, e.g. only usage); an error raises."""
    if "error" in chunk:
        raise ServerError(_error_text(chunk["error"]))
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise ServerError(f"a chunk without choices: {json.dumps(chunk)[:200]}")
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            content = (choice.get("delta") or {}).get("content")
            return content if isinstance(content, str) else ""
    return ""


def api_error(what: str, status: int, body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's first line; with the HTTP status."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        value = None
    if isinstance(value, dict) and "error" in value:
        return f"{_error_text(value['error'])} (HTTP {status})"
    lines = body.decode("utf-8", errors="replace").strip().splitlines()
    return f"{what}: {one_line(lines[0][:200]) if lines else '(empty answer)'} (HTTP {status})"


def _error_text(error) -> str:
    message = error.get("message") if isinstance(error, dict) else error
    return one_line(message if message else json.dumps(error)[:200])

