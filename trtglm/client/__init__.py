"""Clients of a served model repository's `ensemble` and `tensorrt_llm_bls` models.

http.py speaks Triton's HTTP generate extension (`/generate`, and `/generate_stream` as
server-sent events read incrementally); grpc.py uses tritonclient's gRPC bidirectional stream
(`start_stream` / `async_stream_infer`). Both take a `GenerateRequest` and yield the reply's
text pieces as they arrive: one piece for a whole reply, new text only for a streamed one
(the repository's `accumulate_tokens` false). `trtglm generate` is trtglm/cli/client.py.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from trtglm.errors import TrtglmError, UsageError

MODELS = ("ensemble", "tensorrt_llm_bls")  # the client-facing models of the repository
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # for loopback: never through a proxy
INT32_MAX = 2**31 - 1  # the wire's type of max_tokens, top_k and beam_width (over HTTP JSON Triton wraps above)
ANSWER_TIMEOUT_S = 600.0  # how long a client waits for the server's answer (a long generation on a busy server)
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ServerError(TrtglmError):
    """The server could not be reached, refused the request or answered with an error."""


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call; the optional sampling options are sent only when set."""

    text: str  # a prompt, or a JSON chat (a list of messages or {"messages": [...]}), sent as is
    max_tokens: int
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    beam_width: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.text, str) and self.text != "", f"--prompt must be non-empty text, not {self.text!r}")
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX,
               f"--max-tokens must be a whole number from 1 to {INT32_MAX} (Triton's INT32), not {self.max_tokens!r}")
        _check(self.temperature is None or (_is_number(self.temperature) and self.temperature >= 0),
               f"--temperature must be a number ≥ 0, not {self.temperature!r}")
        _check(self.top_k is None or (_is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX),
               f"--top-k must be a whole number from 0 to {INT32_MAX}, not {self.top_k!r}")
        _check(self.top_p is None or (_is_number(self.top_p) and 0 < self.top_p <= 1),
               f"--top-p must be a number in (0, 1], not {self.top_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
               f"--seed must be a whole number in [0, 2^64), not {self.seed!r}")
        _check(self.beam_width is None or (_is_int(self.beam_width) and 1 <= self.beam_width <= INT32_MAX),
               f"--beam-width must be a whole number from 1 to {INT32_MAX}, not {self.beam_width!r}")

    def inputs(self) -> dict[str, str | int | float | bool]:
        """The model inputs by name (Triton's names), leaving out options that are not set."""
        values = {"text_input": self.text, "max_tokens": self.max_tokens, "stream": self.stream,
                  "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                  "random_seed": self.seed, "beam_width": self.beam_width}
        return {name: value for name, value in values.items() if value is not None}


def check_model(model: str) -> str:
    """A model name safe to put in a URL path."""
    if not isinstance(model, str) or not _MODEL_NAME.match(model):
        raise UsageError(f"--model must be a model name such as {' or '.join(MODELS)}, not {model!r}")
    return model


def split_url(url: str, flag: str, expected: str) -> SplitResult:
    """`url`'s parts (http:// added to a bare HOST:PORT); a UsageError naming `flag` for one that cannot be read."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        parts.port  # noqa: B018: reading it checks it
    except ValueError:
        raise UsageError(f"{flag} {url}: expected {expected}") from None
    return parts


def one_line(message) -> str:
    """A server's message on one line (error lines must stay one line)."""
    return " ".join(str(message).split())


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
