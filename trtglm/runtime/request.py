"""What the executor (executor.py) takes and gives: `Request` (TensorRT-LLM's request fields that
trtglm's runtime honours, its settings grouped in trtglm.request_config's `SamplingConfig` and
`OutputConfig`), `Output` (what one step gave a request), the `Handle` that cancels
one, the executor's errors and counters, and `check_request`, which refuses a request a model
cannot serve before it is queued."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trtglm.errors import TrtglmError, UsageError
from trtglm.request_config import OutputConfig, SamplingConfig, check_sampling

log = logging.getLogger(__name__)


class QueueFullError(TrtglmError):
    """Every slot is busy and the waiting queue is full."""


class ExecutorStopped(TrtglmError):
    """The executor no longer takes requests (stopped, or its model failed for good)."""


@dataclass(frozen=True)
class Request:
    """One sequence to generate (TensorRT-LLM's executor `Request`: the fields that trtglm's runtime honours)."""

    prompt: Sequence[int]
    max_tokens: int
    end_id: int | None = None
    stop_words: Sequence[Sequence[int]] = ()
    bad_words: Sequence[Sequence[int]] = ()
    embedding_bias: torch.Tensor | None = None  # [vocab] added to the logits
    sampling: SamplingConfig = SamplingConfig()
    output: OutputConfig = OutputConfig()


@dataclass
class Beam:
    """One beam of a beam search (beams.py)."""

    tokens: list[int]  # generated, the ending token included
    cum_log_prob: float
    score: float  # cum_log_prob / len(tokens) ** length_penalty: what beams are ranked by
    log_probs: list[float] = field(default_factory=list)  # each token's
    logits: list = field(default_factory=list, compare=False)  # the raw logits row each token was chosen from


@dataclass(frozen=True)
class KvBlocks:
    """A request's share of the KV cache, as TensorRT-LLM's perf metrics count it."""

    total: int  # blocks its positions (each beam's) take so far
    reused: int  # of them, prompt blocks the prefix cache held

    @property
    def new(self) -> int:
        return self.total - self.reused


@dataclass
class Output:
    """What one step gave a request."""

    tokens: list[int]  # new since the previous Output
    log_probs: list[float] = field(default_factory=list)  # one per new token, when asked for
    finished: bool = False
    reason: str | None = None  # end_id | stop_word | length | cancelled | error
    error: str | None = None
    beams: list[Beam] = field(default_factory=list)  # beam search: every beam, best first (only when finished)
    # on a request's first Output: when it got its slot (time.time_ns()); timing, not content, so not compared
    scheduled_ns: int | None = field(default=None, compare=False)
    # KV-cache blocks its positions take so far and how many of them came from the prefix cache (once placed)
    kv_blocks: KvBlocks | None = field(default=None, compare=False)
    # float32 [prompt length, vocab], on the first Output, when the request asks for it
    context_logits: np.ndarray | None = field(default=None, compare=False)
    # float32 [len(tokens), vocab]: the model's logits each new token was chosen from, when the request asks
    generation_logits: np.ndarray | None = field(default=None, compare=False)


OutputCallback = Callable[[Output], None]


@dataclass
class ExecutorStats:
    queued: int = 0  # requests waiting for a slot or KV-cache room
    active: int = 0  # requests in slots: prefilling or generating
    prefilling: int = 0  # of those, the ones whose prompt is not all computed yet
    slots: int = 0  # the most requests in slots at once (max batch size)
    kv_blocks: int = 0  # the KV cache, in blocks of `tokens_per_block` positions
    kv_blocks_used: int = 0  # held by requests in slots (each holds its whole length from admission)
    tokens_per_block: int = 0
    steps: int = 0
    prefill_calls: int = 0  # forward passes that carried prompt tokens (with the running requests' decode tokens)
    prefill_chunks: int = 0  # prompt pieces prefilled (a prompt prefilled in one step counts one)
    prefill_tokens: int = 0  # prompt tokens computed
    reused_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache instead
    decode_calls: int = 0  # forward passes that carried decode tokens (with prompt tokens or without)
    generated_tokens: int = 0
    max_decode_batch: int = 0  # the largest number of requests decoded together
    step_us: int = 0  # time spent in steps (the rest of the time the executor waited for work)
    # Steps that ran decode tokens alone (overlapped: and handed out a pass of decode tokens alone), and their time:
    # the served decode step, without the prompts' passes.
    decode_only_steps: int = 0
    decode_only_us: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0

    # The executor's counters are written here alone.

    def count_pass(self, decoded: int, chunks: int, prompt_tokens: int) -> None:
        """A forward pass of `decoded` requests' decode tokens and `chunks` prompt chunks of `prompt_tokens` in all."""
        self.prefill_calls += bool(chunks)
        self.prefill_chunks += chunks
        self.prefill_tokens += prompt_tokens
        self.decode_calls += bool(decoded)
        self.max_decode_batch = max(self.max_decode_batch, decoded)

    def count_step(self, took_us: int, completed: bool, decode_only: bool) -> None:
        """A step of `took_us` (`completed`: the model did not fail) that ran decode tokens alone or not."""
        self.steps += completed
        self.step_us += took_us
        if decode_only:
            self.decode_only_steps += 1
            self.decode_only_us += took_us

    def count_admitted(self, reused_tokens: int) -> None:
        self.reused_tokens += reused_tokens

    def count_generated(self) -> None:
        self.generated_tokens += 1

    def count_end(self, reason: str | None) -> None:
        self.finished += 1
        self.cancelled += reason == "cancelled"

    def count_rejected(self) -> None:
        self.rejected += 1


class Handle:
    """A submitted request; `cancel()` stops it at the next step."""

    def __init__(self, number: int):
        self.id = number
        self.cancelled = False
        self.done = threading.Event()

    def cancel(self) -> None:
        self.cancelled = True


# Logits a request may ask for, in MiB (TRTGLM_MAX_LOGITS_MIB sets another cap): each response of them is copied
# from the engine's process to the stub and through the python backend's shared memory (a container's /dev/shm
# is 64 MiB unless it is given more), and a request's generation logits are all held until its last token.
# ChatGLM3's 65024-id rows make 256 MiB about a thousand prompt positions, or as many generated tokens.
MAX_LOGITS_MIB, MAX_LOGITS_ENV = 256, "TRTGLM_MAX_LOGITS_MIB"
LOGITS_ITEM_BYTES = 4  # float32


def fitted(request: Request, max_seq_len: int) -> Request:
    """`request` with its output length cut to what fits in `max_seq_len` after the prompt, as TensorRT-LLM's
    executor clamps it (with a warning) instead of refusing the request."""
    room = max_seq_len - len(request.prompt)
    if request.max_tokens <= room:
        return request
    log.warning("the prompt (%d tokens) plus request_output_len (%d) exceeds max_seq_len (%d): generating at most %d "
                "tokens", len(request.prompt), request.max_tokens, max_seq_len, room)
    return dataclasses.replace(request, max_tokens=room)


def check_request(request: Request, vocab: int, max_seq_len: int, max_beam_width: int = 1) -> None:
    """UsageError when `request` cannot be served by a model of `vocab` ids, `max_seq_len` positions and
    `max_beam_width` beams."""
    prompt = request.prompt
    if len(prompt) == 0:
        raise UsageError("the prompt is empty")
    if request.max_tokens < 1:
        raise UsageError(f"request_output_len must be at least 1, not {request.max_tokens}")
    if len(prompt) >= max_seq_len:
        raise UsageError(f"the prompt ({len(prompt)} tokens) leaves no room for a token within max_seq_len "
                         f"({max_seq_len})")
    words = [t for word in (*request.stop_words, *request.bad_words) for t in word]
    ends = [request.end_id] if request.end_id is not None else []
    bad = [t for t in (*prompt, *words, *ends) if not 0 <= int(t) < vocab]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    check_sampling(request.sampling, max_beam_width)
    check_logits(request, vocab, max_seq_len)
    if request.embedding_bias is not None and request.embedding_bias.numel() > vocab:
        raise UsageError(f"embedding_bias has {request.embedding_bias.numel()} values, more than the vocabulary "
                         f"({vocab})")


def check_logits(request: Request, vocab: int, max_seq_len: int) -> None:
    """UsageError when the logits `request` asks for would take more than the cap (MAX_LOGITS_MIB; its output
    length cut to what fits in `max_seq_len`, as `fitted` cuts it)."""
    output = min(request.max_tokens, max_seq_len - len(request.prompt))
    asked = request.output
    rows = {"return_context_logits": len(request.prompt) if asked.return_context_logits else 0,
            "return_generation_logits": request.sampling.beam_width * output if asked.return_generation_logits else 0}
    size, cap = sum(rows.values()) * vocab * LOGITS_ITEM_BYTES, max_logits_mib()
    if size > cap << 20:
        asked = " and ".join(name for name, count in rows.items() if count)
        raise UsageError(f"{asked}: {sum(rows.values())} rows of {vocab} float32 logits take {size / (1 << 20):.1f} "
                         f"MiB, more than the {cap} MiB a request may ask for ({MAX_LOGITS_ENV}); shorten the prompt "
                         "or request_output_len, or leave the flag out")


def max_logits_mib() -> int:
    """The cap on a request's logits: TRTGLM_MAX_LOGITS_MIB, else MAX_LOGITS_MIB."""
    text = os.environ.get(MAX_LOGITS_ENV, "")
    if not text:
        return MAX_LOGITS_MIB
    if not text.isdigit():
        raise UsageError(f"{MAX_LOGITS_ENV} must be a whole number of MiB, not {text!r}")
    return int(text)
