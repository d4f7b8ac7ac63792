"""Triton's HTTP generate extension: `POST /v2/models/{model}/generate` and `/generate_stream`; and `/infer`.

`/generate` answers one JSON object holding the outputs (`text_output`). `/generate_stream`
answers `text/event-stream`: one `data: {…}` event per response, read line by line as it
arrives. Errors come as `{"error": "…"}` with a 4xx/5xx status, or as an event inside an
HTTP 200 stream once streaming has begun. No proxy is used: the server is addressed directly.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from trtglm.client import ANSWER_TIMEOUT_S, GenerateRequest, ServerError, check_model, one_line, split_url
from trtglm.errors import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Server:
    """An HTTP endpoint (Triton's unless `what` says otherwise), from `http://HOST:PORT`, `https://HOST:PORT`
    or `HOST:PORT`; `flag` names where the URL came from in errors."""

    url: str
    host: str
    port: int
    tls: bool
    what: str = "Triton"

    @classmethod
    def parse(cls, url: str, flag: str = "--url", what: str = "Triton") -> "Server":
        if not isinstance(url, str) or not url:
            raise UsageError(f"{flag} must be http://HOST:PORT, not {url!r}")
        parts = split_url(url, flag, "http://HOST:PORT")
        port = parts.port
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise UsageError(f"{flag} {url}: expected http://HOST:PORT")
        tls = parts.scheme == "https"
        return cls(url.rstrip("/"), parts.hostname, port or (443 if tls else 80), tls, what)

    @contextmanager
    def request(self, method: str, path: str, body: bytes | None,
                timeout: float) -> Iterator[http.client.HTTPResponse]:
        """The open response to one request (JSON in, JSON or events out); the connection closes after."""
        kind = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
        connection = kind(self.host, self.port, timeout=timeout)
        headers = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            try:
                connection.request(method, path, body=body, headers=headers)
                response = connection.getresponse()
            except OSError as e:
                raise self.unreachable(e) from None
            yield response
        finally:
            connection.close()

    def get_json(self, path: str, timeout: float = 30.0) -> dict:
        """A GET answered with a JSON object (e.g. a model's config); ServerError otherwise."""
        with self.request("GET", path, None, timeout) as response:
            body = read_body(self, response)
        if response.status != 200:
            raise ServerError(error_message(f"GET {path}", response.status, body))
        return json_object(f"GET {path}", body)

    def unreachable(self, error: OSError) -> ServerError:
        if isinstance(error, socket.timeout):
            return ServerError(f"no answer from {self.what} at {self.url} in time")
        return ServerError(f"cannot reach {self.what} at {self.url}: {error.strerror or error}")


def generate(url: str, model: str, request: GenerateRequest, timeout: float = ANSWER_TIMEOUT_S) -> str:
    """The whole reply of `model` (one response) through `/generate`."""
    server, path = Server.parse(url), f"/v2/models/{check_model(model)}/generate"
    log.debug("POST %s%s", server.url, path)
    with server.request("POST", path, _body(request), timeout) as response:
        body = read_body(server, response)
    if response.status != 200:
        raise ServerError(error_message(model, response.status, body))
    return output_text(json_object(model, body))


def generate_stream(url: str, model: str, request: GenerateRequest,
                    timeout: float = ANSWER_TIMEOUT_S) -> Iterator[str]:
    """The reply's text pieces as `/generate_stream` sends them (each event's text_output)."""
    server, path = Server.parse(url), f"/v2/models/{check_model(model)}/generate_stream"
    log.debug("POST %s%s", server.url, path)
    with server.request("POST", path, _body(request), timeout) as response:
        if response.status != 200:
            raise ServerError(error_message(model, response.status, read_body(server, response)))
        for data in sse_data(event_lines(server, response)):
            piece = output_text(json_object(model, data.encode("utf-8")), streamed=True)
            if piece:
                yield piece


def infer(url: str, model: str, inputs: list[dict], timeout: float = ANSWER_TIMEOUT_S) -> dict[str, list]:
    """The outputs (name -> data) of one `/v2/models/{model}/infer`; `inputs` as Triton's JSON writes them
    ({name, datatype, shape, data})."""
    server, path = Server.parse(url), f"/v2/models/{check_model(model)}/infer"
    log.debug("POST %s%s", server.url, path)
    with server.request("POST", path, json.dumps({"inputs": inputs}, ensure_ascii=False).encode(), timeout) as response:
        body = read_body(server, response)
    if response.status != 200:
        raise ServerError(error_message(model, response.status, body))
    outputs = json_object(model, body).get("outputs")
    if not isinstance(outputs, list) or not all(isinstance(output, dict) and "name" in output for output in outputs):
        raise ServerError(f"{model}: the answer has no list of named outputs: {body[:200]!r}")
    return {output["name"]: output.get("data") for output in outputs}


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The data of each server-sent event, from the stream's lines (with their line endings).

    An event ends at a blank line; several `data:` lines of one event join with newlines;
    comments (`:`) and other fields are skipped (the text/event-stream format).
    """
    data: list[str] = []
    for raw in lines:
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise ServerError(f"the event stream is not UTF-8: {raw[:100]!r}") from None
        if not line:
            if data:
                yield "\n".join(data)
            data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:  # a last event the server did not end with a blank line
        yield "\n".join(data)


def output_text(output: dict, streamed: bool = False) -> str:
    """An answer's `text_output` (a string, or a list of strings for several beams: one a line); errors raise."""
    if "error" in output:
        raise ServerError(one_line(output["error"]))
    text = output.get("text_output")
    if text is None:
        if streamed:  # e.g. a response carrying only log probabilities
            return ""
        raise ServerError(f"the answer has no text_output: {json.dumps(output)[:200]}")
    if isinstance(text, list):
        return "\n".join(str(piece) for piece in text)
    return str(text)


def _body(request: GenerateRequest) -> bytes:
    return json.dumps(request.inputs(), ensure_ascii=False).encode("utf-8")


def read_body(server: Server, response: http.client.HTTPResponse) -> bytes:
    try:
        return response.read()
    except OSError as e:
        raise server.unreachable(e) from None


def event_lines(server: Server, response: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        try:
            line = response.readline()
        except (OSError, http.client.IncompleteRead) as e:
            if isinstance(e, OSError):
                raise server.unreachable(e) from None
            raise ServerError(f"the event stream from {server.url} broke off") from None
        if not line:
            # readline() ends a chunked body quietly even when the connection dropped before its last
            # (empty) chunk, as when the server dies mid-stream; http.client leaves chunk_left at 0 then
            # and None after a complete body.
            if response.chunked and response.chunk_left is not None:
                raise ServerError(f"the event stream from {server.url} broke off (the server stopped answering)")
            return
        yield line


def json_object(model: str, body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ServerError(f"{model}: the answer is not JSON: {body[:200]!r}") from None
    if not isinstance(value, dict):
        raise ServerError(f"{model}: the answer is not a JSON object: {body[:200]!r}")
    return value


def error_message(model: str, status: int, body: bytes) -> str:
    """Triton's `{"error": …}` text (a JSON body, or the first event of a stream), else the body's first line."""
    message = None
    for candidate in (body, *_events(body)):
        try:
            value = json.loads(candidate)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(value, dict) and "error" in value:
            message = value["error"]
            break
    if message is None:
        lines = body.decode("utf-8", errors="replace").strip().splitlines()
        message = lines[0][:200] if lines else "(empty answer)"
    return f"{model}: {one_line(message)} (HTTP {status})"


def _events(body: bytes) -> list[str]:
    """The event data in an error body sent as a stream (Triton sets the status from a first error)."""
    try:
        return list(sse_data(body.splitlines(keepends=True)))
    except ServerError:
        return []
