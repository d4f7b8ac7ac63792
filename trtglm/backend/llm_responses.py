"""The tensorrt_llm model's responses: the executor's Outputs -> NVIDIA's output tensors.

Outputs, as the repository's config declares them (`[1, beam, …]`: each response is one sequence's, as
in NVIDIA's backend; the input never included): output_ids and output_log_probs hold the response's
tokens, sequence_length how many there are, cum_log_probs the sum of the log probabilities so far
(zeros unless return_log_probs), generated_ids every token so far, num_output_tokens their count,
is_final whether this is the sequence's last response and finish_reason why it ended (stop or length, on the
last; "" before); the performance metrics (`Timing`) and
the logits (`Logits`) go with every response, and the model sends each when its return_* flag asks.
`Responder` turns one sequence's outputs into responses: not streaming, one with every token once it finishes;
streaming, one per output, the last one flagged final. A beam search answers once, with every beam
(`[1, beams, …]`, best first, shorter beams padded with -1 as NVIDIA's backend pads them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection

import numpy as np

from trtglm.runtime.beams import Beam
from trtglm.runtime.executor import Output
from trtglm.runtime.request import KvBlocks

PADDING = -1  # past a beam's length in a response of several beams (NVIDIA's padding)
# the executor's reason a sequence ended -> finish_reason (OpenAI's and NVIDIA's LLM-API words); "" until it ends
FINISH_REASONS = {"end_id": "stop", "stop_word": "stop", "length": "length"}


def response_arrays(new_ids: list[int], new_log_probs: list[float], all_ids: list[int], cum_log_prob: float,
                    final: bool, reason: str | None = None) -> dict[str, np.ndarray]:
    """Every output tensor of one response ([batch 1, beam 1, …]); `reason`: the executor's, on the last."""
    arrays = beam_arrays([Beam(new_ids, cum_log_prob, 0.0, new_log_probs)], final, reason)
    arrays["generated_ids"] = np.array(all_ids, dtype=np.int32).reshape(1, 1, len(all_ids))
    arrays["num_output_tokens"] = np.array([[len(all_ids)]], dtype=np.int32)
    return arrays


def beam_arrays(beams: list[Beam], final: bool = True, reason: str | None = None) -> dict[str, np.ndarray]:
    """Every output tensor of one response holding `beams` whole ([batch 1, beams, …], the shorter padded);
    log probs are zeros where a beam has none (return_log_probs off)."""
    width = max(len(beam.tokens) for beam in beams)

    def padded(values: list, count: int) -> list:
        return values + [PADDING] * (width - count)

    ids = np.array([[padded(list(beam.tokens), len(beam.tokens)) for beam in beams]], dtype=np.int32).reshape(
        1, len(beams), width)
    log_probs = [beam.log_probs if len(beam.log_probs) == len(beam.tokens) else [0.0] * len(beam.tokens)
                 for beam in beams]
    arrays = {
        "output_ids": ids,
        "sequence_length": np.array([[len(beam.tokens) for beam in beams]], dtype=np.int32),
        "cum_log_probs": np.array([[beam.cum_log_prob for beam in beams]], dtype=np.float32),
        "output_log_probs": np.array([[padded(row, len(row)) for row in log_probs]], dtype=np.float32).reshape(
            1, len(beams), width),
        "generated_ids": ids,
        "is_final": np.array([[final]], dtype=bool),
        "num_output_tokens": np.array([[width]], dtype=np.int32),
        "finish_reason": np.array([[FINISH_REASONS.get(reason, "").encode()]], dtype=object),
    }
    if any(beam.logits for beam in beams):
        arrays["generation_logits"] = beam_logits(beams, width)
    return arrays


def beam_logits(beams: list[Beam], width: int) -> np.ndarray:
    """A beam search's generation logits `[1, beams, width, vocab]`, each beam's rows, the shorter padded."""
    vocab = next(len(row) for beam in beams for row in beam.logits)
    out = np.full((1, len(beams), width, vocab), PADDING, dtype=np.float32)
    for index, beam in enumerate(beams):
        if beam.logits:
            out[0, index, :len(beam.logits)] = np.stack(beam.logits)
    return out


class Timing:
    """A sequence's performance metrics as NVIDIA's return_perf_metrics outputs give them (time.time_ns()
    clock). The KV-cache figures are the executor's: the blocks of `tokens_per_block` positions the sequence's
    positions take so far, and those of its prompt found in the prefix cache; there are no draft tokens."""

    OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
               "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
               "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")

    def __init__(self, arrival_ns: int):
        self.arrival_ns = arrival_ns
        self.scheduled_ns = self.first_token_ns = self.last_token_ns = 0
        self.kv_blocks = KvBlocks(0, 0)

    def update(self, output: Output) -> None:
        if output.scheduled_ns is not None:
            self.scheduled_ns = output.scheduled_ns
        if output.kv_blocks is not None:
            self.kv_blocks = output.kv_blocks
        if output.tokens:
            self.last_token_ns = time.time_ns()
            self.first_token_ns = self.first_token_ns or self.last_token_ns

    def arrays(self) -> dict[str, np.ndarray]:
        blocks = self.kv_blocks
        values = (blocks.new, blocks.reused, blocks.total, self.arrival_ns, self.scheduled_ns, self.first_token_ns,
                  self.last_token_ns, 0.0, 0, 0)
        return {name: np.array([[value]]) for name, value in zip(self.OUTPUTS, values, strict=True)}


class Logits:
    """A sequence's logits as NVIDIA's backend returns them (float32, the engine's padded vocabulary):
    context_logits `[1, prompt, vocab]` in every response; generation_logits of the tokens so far
    `[1, beam 1, tokens, vocab]`, or streamed, of the response's new tokens `[1, tokens, beam 1, vocab]`
    (TensorRT-LLM keeps a streamed request's rows token-major). Empty arrays where the request asked for
    none: the model sends them only when the request's return_* flag asks."""

    OUTPUTS = ("context_logits", "generation_logits")

    def __init__(self, streaming: bool):
        self.streaming = streaming
        self.context = np.zeros((0, 0), dtype=np.float32)
        self.rows: list[np.ndarray] = []  # not streaming: every token's; streaming: the next response's
        self.width = 0

    def update(self, output: Output) -> None:
        if output.context_logits is not None:
            self.context = output.context_logits
        if output.generation_logits is not None:
            self.rows.append(output.generation_logits)
            self.width = output.generation_logits.shape[-1]

    def arrays(self) -> dict[str, np.ndarray]:
        rows = np.concatenate(self.rows) if self.rows else np.zeros((0, self.width), dtype=np.float32)
        if self.streaming:
            self.rows = []
        generation = rows[:, None] if self.streaming else rows[None]
        return {"context_logits": self.context[None], "generation_logits": generation[None]}


class Responder:
    """Turns one request's executor Outputs into responses (`send(arrays, final)` or `fail(message)`). The perf
    metrics and logits are kept only when `wanted` (the output names the response will carry; None: all)
    holds some of them: a streamed response goes out for every token."""

    def __init__(self, streaming: bool, send: Callable[[dict, bool], None], fail: Callable[[str], None],
                 arrival_ns: int = 0, wanted: Collection[str] | None = None):
        self.streaming, self.send, self.fail = streaming, send, fail
        self.ids: list[int] = []
        self.log_probs: list[float] = []
        self.logits = Logits(streaming) if _asks(wanted, Logits.OUTPUTS) else None
        self.timing = Timing(arrival_ns) if _asks(wanted, Timing.OUTPUTS) else None
        self.gone = False  # a response could not be sent: the client is gone

    def __call__(self, output: Output) -> None:
        if self.gone:
            return
        try:
            self._handle(output)
        except Exception as e:
            self.gone = True
            # A client that is gone takes no error either; anything else must not leave the request unanswered.
            with contextlib.suppress(Exception):
                self.fail(f"its response could not be made or sent: {e}")
            raise

    def _handle(self, output: Output) -> None:
        before = len(self.ids)
        self.ids += output.tokens
        self.log_probs += output.log_probs
        for kept in (self.logits, self.timing):
            if kept is not None:
                kept.update(output)
        if output.error or output.reason == "cancelled":
            self.fail(output.error or "the request was cancelled")
        elif output.beams:
            self.send({**self._kept(self.logits), **beam_arrays(output.beams, True, output.reason)}, True)
        elif self.streaming:
            self.send({**response_arrays(self.ids[before:], self.log_probs[before:], self.ids, sum(self.log_probs),
                                         output.finished, output.reason), **self._kept(self.timing, self.logits)},
                      output.finished)
        elif output.finished:
            self.send({**response_arrays(self.ids, self.log_probs, self.ids, sum(self.log_probs), True, output.reason),
                       **self._kept(self.timing, self.logits)}, True)

    @staticmethod
    def _kept(*parts: Timing | Logits | None) -> dict[str, np.ndarray]:
        return {name: array for part in parts if part is not None for name, array in part.arrays().items()}


def _asks(wanted: Collection[str] | None, outputs: tuple[str, ...]) -> bool:
    return wanted is None or not set(outputs).isdisjoint(wanted)
