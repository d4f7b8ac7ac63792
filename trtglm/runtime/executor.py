"""In-flight batching over a `SlotModel` (trtglm.runtime.slots): requests join and leave the running
batch at every step.

Requests wait in a bounded queue (a full queue refuses new ones with `QueueFullError`). Each
step of the executor:

1. drops cancelled requests, queued, prefilling or running (their slots are released at once);
2. prefills, in one call, at most `max_prefill_tokens` prompt tokens: first the next chunks of
   the prompts already being prefilled (oldest request first), then the prompts of queued
   requests admitted into free slots while the budget lasts. A prompt longer than what is left
   of the budget is prefilled in chunks over several steps, holding its slot meanwhile; the
   request gets its first token from its last chunk;
3. decodes every request whose prompt was complete before this step, one token each, in one
   batch.

So a long prompt never stalls the running requests for more than one budget's worth of
prefill per step, and chunked prefill gives the tokens an unchunked one gives (each chunk
continues its slot's cache).

Each new token goes to its request's callback as an `Output` (the new tokens, their log
probabilities, whether it is finished and why). A request finishes at `end_id` (which is not
returned), after a stop word (which is returned, as TensorRT-LLM returns it), after
`max_new_tokens`, or when cancelled. Tokens are chosen by TensorRT-LLM's rules (sampling.py:
embedding bias, bad words, `end_id` banned before `min_length`, then greedy or the request's
own seeded temperature / top-k / top-p sampling, and log probabilities of the distribution
the token was chosen from).

`step()` runs one step on the calling thread (tests drive it so); `start()` runs steps on a
background thread whenever there is work. The types a caller hands in and gets back (`Request`,
`Output`, `Handle`, the errors, `ExecutorStats`) and the request checks are in request.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from trtglm.errors import UsageError
from trtglm.runtime.request import (ExecutorStats, ExecutorStopped, Handle, Output, OutputCallback, QueueFullError,
                                    Request, check_request, fitted)
from trtglm.runtime.sampling import BadWords, Penalties, Sampler, processed
from trtglm.runtime.slots import SlotModel

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.05  # how often running requests' `is_cancelled` is asked (it may be a remote call)


class _Sequence:
    """A request's state while queued and running."""

    def __init__(self, handle: Handle, request: Request, on_output: OutputCallback,
                 is_cancelled: Callable[[], bool] | None, device: torch.device):
        self.handle, self.request, self.on_output, self.is_cancelled = handle, request, on_output, is_cancelled
        self.history = [int(t) for t in request.prompt]  # prompt + generated, for word matching
        self.prefilled = 0  # prompt tokens in the slot's cache so far
        self.generated = 0
        self.slot: int | None = None
        self.scheduled_ns: int | None = None  # when it got its slot, until its first Output carries it
        self.sampler = Sampler(request.temperature, request.top_k, request.top_p, request.seed, device)
        self.penalties = Penalties(request.repetition_penalty, request.presence_penalty, request.frequency_penalty,
                                   request.temperature)
        self.stops_by_last = _by_last_token(request.stop_words)
        self.bad_words = BadWords(request.bad_words)

    @property
    def unprefilled(self) -> int:
        return len(self.request.prompt) - self.prefilled

    def wants_cancel(self, ask: bool) -> bool:
        if self.handle.cancelled:
            return True
        if ask and self.is_cancelled is not None:
            try:
                return bool(self.is_cancelled())
            except Exception:  # the request is gone
                return True
        return False

    def banned(self) -> list[int]:
        banned = self.bad_words.banned(self.history)
        if self.request.end_id is not None and self.generated < self.request.min_length:
            banned.append(self.request.end_id)
        return banned

    def plain_greedy(self) -> bool:
        """Greedy with nothing to adjust: the next token is the row's argmax."""
        request = self.request
        return (self.sampler.greedy and request.embedding_bias is None and not request.log_probs
                and not self.penalties.active and not self.banned())

    def stop_word_ends(self) -> bool:
        return any(self.history[-len(w):] == w for w in self.stops_by_last.get(self.history[-1], ()))


def _by_last_token(words: Sequence[Sequence[int]]) -> dict[int, list[list[int]]]:
    table: dict[int, list[list[int]]] = {}
    for word in words:
        if len(word):
            table.setdefault(int(word[-1]), []).append([int(t) for t in word])
    return table


class Executor:
    """In-flight batching of `Request`s over `model` (see the module docstring)."""

    def __init__(self, model: SlotModel, max_queue: int = 64, max_prefill_tokens: int | None = None,
                 device: torch.device | str = "cpu", vocab_limit: int | None = None,
                 on_step_end: Callable[[], None] | None = None):
        """`vocab_limit`: ids at or above it (the padding of an engine's vocabulary past its tokenizer's) are
        never chosen. `on_step_end` is called after every step, on the step's thread (to send a step's outputs
        together)."""
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, not {max_queue}")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise UsageError(f"max_prefill_tokens must be >= 1, not {max_prefill_tokens}")
        self.model = model
        self.on_step_end = on_step_end
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens or model.max_seq_len  # whole prompts: no chunks
        self.vocab_limit = min(vocab_limit or model.vocab_size, model.vocab_size)
        self.device = torch.device(device)
        self._lock = threading.Condition()
        self._queue: deque[_Sequence] = deque()
        self._active: dict[int, _Sequence] = {}  # slot -> sequence
        self._numbers = itertools.count()
        self._stats = ExecutorStats()
        self._stopping = False
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self._last_cancel_check = 0.0

    # --- taking requests ----------------------------------------------------------------------

    def submit(self, request: Request, on_output: OutputCallback,
               is_cancelled: Callable[[], bool] | None = None) -> Handle:
        """Queue `request`; its outputs go to `on_output` (on the executor's thread).

        UsageError for a request the model cannot serve, QueueFullError when the queue is full,
        ExecutorStopped once stopped.
        """
        self.check(request)
        request = fitted(request, self.model.max_seq_len)
        handle = Handle(next(self._numbers))
        sequence = _Sequence(handle, request, on_output, is_cancelled, self.device)
        with self._lock:
            if self._stopping or self._failed:
                raise ExecutorStopped(self._failed or "the executor is stopping")
            if len(self._queue) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFullError(f"busy: {len(self._queue)} requests already wait for the {self.model.max_batch} "
                                     "slots (the queue is full); retry later")
            self._queue.append(sequence)
            self._lock.notify_all()
        return handle

    def check(self, request: Request) -> None:
        """UsageError when `request` cannot be served by this model."""
        check_request(request, self.model.vocab_size, self.model.max_seq_len)

    def stats(self) -> ExecutorStats:
        with self._lock:
            return ExecutorStats(**{**self._stats.__dict__, "queued": len(self._queue), "active": len(self._active)})

    # --- running --------------------------------------------------------------------------------

    def start(self) -> None:
        """Run steps on a background thread whenever there is work."""
        self._thread = threading.Thread(target=self._loop, name="trtglm-executor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish with an error every queued and running request, and end the background thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._abort("the server is shutting down")

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._active)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._queue or self._active):
                    self._lock.wait()
                if self._stopping:
                    break
            self.step()
        self._abort("the server is shutting down")

    def step(self) -> None:
        """One step: drop cancelled requests, prefill the next prompt chunks, decode the running requests."""
        started = time.perf_counter()
        try:
            self._drop_cancelled()
            running = [s for s in self._active.values() if not s.unprefilled]
            chunks = self._plan_prefill()
            if chunks:
                self._prefill(chunks)
            decoding = [s for s in running if self._active.get(s.slot) is s]
            if decoding:
                self._decode(decoding)
            self._stats.steps += 1
        except Exception as e:
            log.exception("the model failed")
            self._recover(e)
        self._stats.step_us += int(1e6 * (time.perf_counter() - started))
        if self.on_step_end is not None:
            self.on_step_end()

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        ask = now - self._last_cancel_check >= CANCEL_CHECK_S
        if ask:
            self._last_cancel_check = now
        for sequence in [s for s in self._active.values() if s.wants_cancel(ask)]:
            self._finish(sequence, Output([], finished=True, reason="cancelled"))
        with self._lock:
            cancelled = [s for s in self._queue if s.wants_cancel(ask)]
            for sequence in cancelled:
                self._queue.remove(sequence)
        for sequence in cancelled:
            self._finish(sequence, Output([], finished=True, reason="cancelled"))

    def _plan_prefill(self) -> list[tuple[_Sequence, int]]:
        """(sequence, chunk length) to prefill this step, within the budget: prompts under way first
        (oldest first), then new requests admitted while budget is left."""
        budget = self.max_prefill_tokens
        under_way = sorted((s for s in self._active.values() if s.unprefilled), key=lambda s: s.handle.id)
        chunks = []
        for sequence in under_way + self._admit(budget - sum(s.unprefilled for s in under_way)):
            length = min(sequence.unprefilled, budget)
            if not length:
                break
            chunks.append((sequence, length))
            budget -= length
        return chunks

    def _admit(self, budget: int) -> list[_Sequence]:
        """Queued requests into free slots while `budget` prompt tokens are left (the last admitted may start
        with a chunk of its prompt)."""
        free = [slot for slot in range(self.model.max_batch) if slot not in self._active]
        admitted = []
        with self._lock:
            while self._queue and free and budget > 0:
                sequence = self._queue.popleft()
                sequence.slot, sequence.scheduled_ns = free.pop(0), time.time_ns()
                self._active[sequence.slot] = sequence
                admitted.append(sequence)
                budget -= len(sequence.request.prompt)
        return admitted

    def _prefill(self, chunks: list[tuple[_Sequence, int]]) -> None:
        sequences = [s for s, _ in chunks]
        starts = [s.prefilled for s in sequences]
        pieces = [s.history[start:start + length] for (s, length), start in zip(chunks, starts)]  # history: the prompt
        logits = self.model.prefill([s.slot for s in sequences], pieces, starts)
        self._stats.prefill_calls += 1
        self._stats.prefill_chunks += len(chunks)
        for sequence, length in chunks:
            sequence.prefilled += length
        complete = [i for i, s in enumerate(sequences) if not s.unprefilled]
        if complete:
            ready = [sequences[i] for i in complete]
            rows = logits if len(ready) == len(sequences) else \
                logits.index_select(0, torch.tensor(complete, device=logits.device))
            for sequence, choice in zip(ready, self._choose_all(ready, rows), strict=True):
                self._take(sequence, choice)

    def _decode(self, sequences: list[_Sequence]) -> None:
        logits = self.model.decode([s.slot for s in sequences], [s.history[-1] for s in sequences])
        self._stats.decode_calls += 1
        self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(sequences))
        for sequence, choice in zip(sequences, self._choose_all(sequences, logits), strict=True):
            self._take(sequence, choice)

    def _choose_all(self, sequences: list[_Sequence], logits: torch.Tensor) -> list[tuple[int, float] | str]:
        """(token, log-prob) per row, or the error that ended that row's request alone. Plain greedy rows
        share one argmax and one device sync; the rest (sampling, bias, banned words, log-probs) go one by
        one. Padded ids past `vocab_limit` are never chosen."""
        logits = logits[:, :self.vocab_limit]
        plain = [i for i, s in enumerate(sequences) if s.plain_greedy()]
        choices: dict[int, tuple[int, float]] = {}
        if plain:
            rows = logits.index_select(0, torch.tensor(plain, device=logits.device))
            choices = {i: (token, 0.0) for i, token in zip(plain, rows.argmax(dim=-1).tolist())}
        return [choices[i] if i in choices else self._choose_alone(s, logits[i]) for i, s in enumerate(sequences)]

    # --- one request's token ------------------------------------------------------------------------

    def _take(self, sequence: _Sequence, choice: tuple[int, float] | str) -> None:
        if isinstance(choice, str):
            self._finish(sequence, Output([], finished=True, reason="error", error=choice))
        else:
            self._advance(sequence, *choice)

    def _choose_alone(self, sequence: _Sequence, row: torch.Tensor) -> tuple[int, float] | str:
        """`_choose`, or the message that ends this request alone when its settings leave nothing to choose."""
        try:
            return self._choose(sequence, row)
        except Exception as e:
            log.warning("request %d: %s", sequence.handle.id, e)
            return f"no next token could be chosen: {e}"

    def _advance(self, sequence: _Sequence, token: int, log_prob: float) -> None:
        request = sequence.request
        if request.end_id is not None and token == request.end_id:
            self._finish(sequence, Output([], finished=True, reason="end_id"))
            return
        sequence.history.append(token)
        sequence.penalties.add(token)
        sequence.generated += 1
        self._stats.generated_tokens += 1
        reason = "stop_word" if sequence.stop_word_ends() else \
            "length" if sequence.generated >= request.max_new_tokens else None
        output = Output([token], [log_prob] if request.log_probs else [], finished=reason is not None, reason=reason)
        if reason is not None:
            self._finish(sequence, output)
        elif not self._deliver(sequence, output):
            self._finish(sequence, Output([], finished=True, reason="cancelled"))

    def _choose(self, sequence: _Sequence, row: torch.Tensor) -> tuple[int, float]:
        if sequence.penalties.active and sequence.penalties.counts is None:
            sequence.penalties.start(sequence.history, row.numel(), row.device)
        logits = processed(row, sequence.request.embedding_bias, sequence.banned(), sequence.penalties)
        token = int(sequence.sampler(logits[None])[0])
        return token, sequence.sampler.log_prob(logits, token) if sequence.request.log_probs else 0.0

    def _finish(self, sequence: _Sequence, output: Output) -> None:
        if sequence.slot is not None and self._active.get(sequence.slot) is sequence:
            del self._active[sequence.slot]
            self.model.release(sequence.slot)
        self._stats.finished += 1
        self._stats.cancelled += output.reason == "cancelled"
        self._deliver(sequence, output)
        sequence.handle.done.set()

    @staticmethod
    def _deliver(sequence: _Sequence, output: Output) -> bool:
        """Hand `output` to the request's callback; False when that fails (the client is gone)."""
        output.scheduled_ns, sequence.scheduled_ns = sequence.scheduled_ns, None
        try:
            sequence.on_output(output)
            return True
        except Exception as e:
            log.warning("request %d: could not deliver its output (%s); stopping it", sequence.handle.id, e)
            return False

    # --- failures ----------------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        """The model raised: end the running requests with the error and free every slot; if even that
        fails, the executor takes no more requests."""
        message = f"the model failed: {type(error).__name__}: {error}"
        running = list(self._active.values())
        self._active.clear()
        for sequence in running:
            self._deliver(sequence, Output([], finished=True, reason="error", error=message))
            sequence.handle.done.set()
        try:
            for slot in range(self.model.max_batch):
                self.model.release(slot)
        except Exception:
            with self._lock:
                self._failed = message
            self._abort(message)

    def _abort(self, message: str) -> None:
        """End every queued and running request with `message`."""
        with self._lock:
            sequences = list(self._queue) + list(self._active.values())
            self._queue.clear()
            self._active.clear()
        for sequence in sequences:
            self._deliver(sequence, Output([], finished=True, reason="error", error=message))
            sequence.handle.done.set()
