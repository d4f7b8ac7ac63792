"""The endpoints' work apart from HTTP: the model list, a request's checks (model, choice counts, prompt length),
its asks of Triton, and its answer, whole or as chunks, with usage.

`n` choices are `n` requests (seed + i each when a seed is given). A request's settings go as one
`SamplingConfig` and one `OutputConfig` (trtglm.request_config), which asks for log probabilities only when the
client asks (`logprobs`), or always when NVIDIA's engine serves tensorrt_llm (it counts tokens only with them:
triton.py). `completion_tokens` counts every generated token, the stop token that ended a reply included.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import numpy as np

from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.openai_api.admission import Admission
from trtglm.openai_api.errors import ApiError
from trtglm.openai_api.prompts import chatglm_messages, completion_messages, prompt_length, token_limit
from trtglm.openai_api.protocol import (MAX_PROMPTS, ChatRequest, CompletionRequest, Sampling, refuse_unsupported,
                                       wants_log_probs)
from trtglm.openai_api.replies import ChoiceText, token_log_probs, tool_calls
from trtglm.openai_api.served import Served
from trtglm.openai_api.streaming import merged
from trtglm.openai_api.triton import Ask, Triton
from trtglm.request_config import OutputConfig, check_return_sequences


BUSY_WAIT_S = 60.0  # how long a choice the engine refuses as busy (other clients filled it) is asked again
BUSY_RETRY_S = 0.2


class Api:
    """The endpoints' work, apart from HTTP."""

    def __init__(self, served: Served, triton: Triton, tokenizer: ChatGLMTokenizer):
        self.served, self.triton, self.tokenizer = served, triton, tokenizer
        self.admission = Admission(served.slots, MAX_PROMPTS * served.max_return_sequences)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served.model_id, "object": "model", "created": 0,
                                            "owned_by": "trtglm"}]}

    def check(self, request: ChatRequest | CompletionRequest) -> None:
        """What a request is checked for before any work: its model, its counts, what this server cannot do."""
        self.check_model(request)
        self.check_counts(request)
        refuse_unsupported(request)

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
        return prompt_length(self.served.limits, self.tokenizer, messages, param)

    def token_limit(self, requested: int | None, prompt_tokens: int) -> int:
        return token_limit(self.served.limits, requested, prompt_tokens)

    def asks(self, request: ChatRequest | CompletionRequest, messages: list[dict], limit: int) -> list[Ask]:
        if request.min_tokens > limit:
            raise ApiError(400, f"min_tokens {request.min_tokens} is more than the answer may take ({limit} tokens: "
                                "max_tokens, or what max_seq_len leaves after the prompt)", "min_tokens", "invalid_value")
        output = OutputConfig(return_log_probs=wants_log_probs(request) or not self.served.trtglm_engine)
        return [Ask(messages, limit, request.sampling_config(i), output, tuple(request.stop_words()), request.stream,
                    reported=self.served.trtglm_engine) for i in range(request.n)]


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` of an answer."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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

    def admit(self, asks: list[Ask]) -> None:
        """Take the request's place in line, or refuse it whole (admission.py) before any of it runs."""
        self.ticket = self.api.admission.admit(len(asks))

    async def choice(self, index: int, ask: Ask) -> tuple[dict, int]:
        """One choice and its completion tokens."""
        raise NotImplementedError

    def choice_chunks(self, index: int, ask: Ask, counts: list[int]) -> AsyncIterator[dict]:
        """One choice's chunks, its completion tokens kept in counts[index]."""
        raise NotImplementedError

    async def answer(self, asks: list[Ask]) -> dict:
        try:
            choices = await asyncio.gather(*(self.choice(i, ask) for i, ask in enumerate(asks)))
        finally:
            self.api.admission.done(self.ticket)
        completion = sum(count for _, count in choices)
        return {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.request.model,
                "choices": [choice for choice, _ in choices], "usage": usage_of(self.prompt_tokens, completion)}

    async def chunks(self, asks: list[Ask]) -> AsyncIterator[dict]:
        counts = [0] * len(asks)
        try:
            async for chunk in merged([self.choice_chunks(i, ask, counts) for i, ask in enumerate(asks)]):
                yield chunk
        finally:
            self.api.admission.done(self.ticket)
        if self.request.include_usage():
            yield self.chunk([], usage=usage_of(self.prompt_tokens, sum(counts)))

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.request.model,
                 "choices": choices}
        if self.request.include_usage():
            chunk["usage"] = usage
        return chunk

    async def replies(self, reply: ChoiceText, ask: Ask, counts: list[int], index: int) -> AsyncIterator[str]:
        """The text of one choice that can be sent, as pieces arrive, once the choice's turn came (admission.py).
        An engine that another client filled refuses it as busy: it is asked again until BUSY_WAIT_S passed."""
        async with self.ticket.place():
            waited_since = time.monotonic()
            while True:
                try:
                    async for piece in self.api.triton.pieces(ask):
                        text = reply.add(piece)
                        counts[index] = reply.tokens
                        if text:
                            yield text
                    return
                except ApiError as e:
                    if e.code != "server_busy" or reply.tokens or time.monotonic() - waited_since > BUSY_WAIT_S:
                        raise
                await asyncio.sleep(BUSY_RETRY_S)


class Chat(Answering):
    """One chat completion request."""

    PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def prepare(self) -> list[Ask]:
        self.api.check(self.request)
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
            message["tool_calls"] = tool_calls(call, streamed=False)
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
            yield self.chunk([{"index": index, "delta": {"tool_calls": tool_calls(call, streamed=True)},
                               "finish_reason": None}])
        elif text:
            yield self.chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
        yield self.chunk([{"index": index, "delta": {}, "finish_reason": reply.finish_reason(call)}])


class Completion(Answering):
    """One completion request: each prompt (one user turn) answered `n` times."""

    PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def prepare(self) -> list[Ask]:
        self.api.check(self.request)
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
