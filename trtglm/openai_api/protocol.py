"""The API's requests as pydantic models, and what this server refuses of them.

Requests are read strictly (types, ranges) but fields this server does not know are ignored, as clients send
many. Requests it understands but cannot answer are refused with 422 (`refuse_unsupported`): the engine gives the
chosen token's log probability only, so top_logprobs > 0 and logprobs > 0 are refused, and log probabilities come
with answers that are not streamed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from trtglm.openai_api.errors import ApiError
from trtglm.request_config import MAX_WORD_BYTES, SamplingConfig

MAX_STOP_WORDS = 4  # as OpenAI's API
MAX_STOP_BYTES = MAX_WORD_BYTES  # each stop string's UTF-8 bytes: streamed text is searched for every one as it comes
MAX_PROMPTS = 16  # prompts of one completions request (each is answered n times)
MAX_BODY_BYTES = 8 * 2**20  # a request's body; read before any parsing, refused (413) past this

StopWord = Annotated[str, Field(max_length=MAX_STOP_BYTES)]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class Function(Lenient):
    name: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.\-]*$")]
    description: str | None = None
    parameters: dict | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: Function


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Lenient):
    include_usage: bool = False


class ResponseFormat(Lenient):
    type: str


Penalty = Annotated[float, Field(ge=-2, le=2)]


class Sampling(Lenient):
    """What chat and completion requests share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1)] = 1  # at most the server's serve.max_return_sequences (Api.check_counts)
    stop: StopWord | Annotated[list[StopWord], Field(max_length=MAX_STOP_WORDS)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM's and trtllm-serve's extension (genai-perf sends it for fixed output lengths): no end before this many
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_words(self) -> list[str]:
        words = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [word for word in words if word]

    def check_stop_bytes(self) -> None:
        """400 for a stop string past MAX_STOP_BYTES in UTF-8 (pydantic counts characters)."""
        for word in self.stop_words():
            if len(word.encode()) > MAX_STOP_BYTES:
                raise ApiError(400, f"stop: a stop string may hold at most {MAX_STOP_BYTES} bytes, not "
                                    f"{len(word.encode()):,}", "stop", "invalid_value")

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_config(self, choice: int = 0) -> SamplingConfig:
        """The settings of choice `choice` of `n` (seed + choice when a seed is given)."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens,
                              seed=None if self.seed is None else (self.seed + choice) % 2**63)


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def offered_tools(self) -> list[Function]:
        """The tools the model may call (none with tool_choice "none")."""
        return [] if self.tool_choice == "none" else [tool.function for tool in self.tools or ()]


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    best_of: Annotated[int, Field(ge=1)] | None = None  # n or fewer (no answer is chosen among more)
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def refuse_unsupported(request: ChatRequest | CompletionRequest) -> None:
    """Requests this server understands but cannot answer (422)."""
    if isinstance(request, ChatRequest):
        if request.top_logprobs:
            raise ApiError(422, "top_logprobs > 0 is not supported: the served models give the chosen token's "
                                "log probability only", "top_logprobs", "unsupported_value")
        if request.response_format is not None and request.response_format.type != "text":
            raise ApiError(422, f"response_format {request.response_format.type!r} is not supported; only 'text'",
                           "response_format", "unsupported_value")
        if request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice):
            raise ApiError(422, "tool_choice can be 'auto' or 'none': ChatGLM3 decides itself whether to call a tool",
                           "tool_choice", "unsupported_value")
    else:
        if request.logprobs:
            raise ApiError(422, "logprobs > 0 is not supported: the served models give the chosen token's log "
                                "probability only (use logprobs: 0)", "logprobs", "unsupported_value")
        if request.best_of is not None and request.best_of > request.n:
            raise ApiError(422, f"best_of {request.best_of} above n {request.n} is not supported: every generated "
                                "choice is returned", "best_of", "unsupported_value")
        if request.echo or request.suffix:
            raise ApiError(422, "echo and suffix are not supported", "echo" if request.echo else "suffix",
                           "unsupported_value")
    if wants_log_probs(request) and request.stream:
        raise ApiError(422, "log probabilities are given for answers that are not streamed", "logprobs",
                       "unsupported_value")


def wants_log_probs(request: ChatRequest | CompletionRequest) -> bool:
    """Whether the client asks for the chosen tokens' log probabilities."""
    return request.logprobs if isinstance(request, ChatRequest) else request.logprobs is not None
