"""In-flight batching over a `SlotModel` (slots.py): requests join and leave the running batch at every step.

An `Executor` holds a `Scheduler` (scheduler.py: the waiting queue, the running requests with their slots and
KV-cache blocks, the prefix cache), a `TokenChooser` (sampling.py: every row's next token in one batched pass on the
model's device), the model, and the pass in flight. Requests wait in a bounded queue (a full queue refuses new ones
with `QueueFullError`). Each step:

1. drops cancelled requests, queued, prefilling or running (their slots are released at once);
2. plans the step (`Scheduler.schedule`) within `max_num_tokens` (TensorRT-LLM's name: tokens of one engine step
   across the batch): a decode token of every running request, and prompt tokens, oldest request first, as far as
   the budget, the free slots and the KV cache allow;
3. launches it all as one forward pass (`SlotModel.step`; a step of decode tokens only is a `decode`, one of prompt
   tokens only a `prefill`: the fast runtime replays CUDA graphs for a decode batch, a lone prompt and a mixed step
   of a few hundred tokens), and every row's token choice after it, queued on the device, not waited for;
4. hands out chosen tokens: the stop rule (`SequenceState.take`), each request's `Output`, finished requests' slots
   given back.

Not overlapped, step 4 hands out this step's tokens: the host waits for its pass. Overlapped (on a GPU, `overlap`),
it hands out the tokens of the step before while this step's pass runs: the host never waits for a pass it could
prepare the next one during. A running request's input is its newest token where the chooser left it
(`TokenChooser.last_tokens`), so nothing needs the previous step's results on the host; a request whose last token
is already on the way is not scheduled again, and one that ends (end id, stop word, cancel) may run one more token
that is never sent. Requests whose choice needs the host (beam search, logits asked for, bad words longer than one
token) make the steps run in turn while they are there.

Chunks give the tokens one prefill gives (each chunk continues its slot's cache), and a mixed pass the tokens
separate passes give; a request gets its first token from its prompt's last chunk.

Each new token goes to its request's callback as an `Output` (the new tokens, their log probabilities, whether it
is finished and why). A request finishes at `end_id` (which is not returned), after a stop word (which is returned,
as TensorRT-LLM returns it), after `max_tokens`, or when cancelled. Tokens are chosen by TensorRT-LLM's rules
(sampling.TokenChooser, which takes each request's settings into its slot at admission: embedding bias, penalties,
bad words, `end_id` and one-token stop words banned before `min_tokens`, then greedy or the request's own seeded
temperature / top-k / top-p sampling, and log probabilities of the distribution the token was chosen from).

Logits, as TensorRT-LLM returns them (float32, the model's whole padded vocabulary), only for a request that asks
(`OutputConfig`): context logits run its prompt chunks on their own (`SlotModel.prefill_all`, never from the prefix
cache) keeping every position's logits, which its first Output carries; generation logits give each Output the raw
logits (before bias, penalties, bans and temperature) each of its tokens was chosen from (a beam search: each
beam's, `Beam.logits`). Other requests' passes are unchanged.

A beam search (`SamplingConfig.beam_width` > 1, beams.py) has its prompt prefilled into its first slot (reusing a
cached prefix as any request's does: every beam's slot holds the same prompt, so the first slot's prompt blocks stay
valid whichever beams survive), then each step's pass takes one decode token per beam beside the other requests'
tokens and chunks; a beam that continues another takes a copy of that one's slot (`SlotModel.copy`). It answers
once, when the search ends, with every beam (`Output.beams`, best first).

`step()` runs one step on the calling thread (tests drive it so); `start()` runs steps on a background thread
whenever there is work. The types a caller hands in and gets back (`Request`, `Output`, `Handle`, the errors,
`ExecutorStats`) and the request checks are in request.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trtglm.conventions import TOKENS_PER_BLOCK
from trtglm.errors import UsageError
from trtglm.runtime.request import (ExecutorStats, ExecutorStopped, Handle, Output, OutputCallback, QueueFullError,
                                    Request, check_request, fitted)
from trtglm.runtime.sampling import Chosen, TokenChooser
from trtglm.runtime.scheduler import Scheduler, StepPlan, shared_kv_blocks
from trtglm.runtime.sequence import SequenceState
from trtglm.runtime.slots import SlotModel
from trtglm.runtime.transfer import upload

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.05  # how often running requests' `is_cancelled` is asked (it may be a remote call)


@dataclass
class LaunchedPass:
    """A launched pass: the sequences whose tokens it chose, and the choice on its way to the host."""

    sequences: list[SequenceState]
    chosen: Chosen
    decode_only: bool = False  # it carried no prompt tokens


class Executor:
    """In-flight batching of `Request`s over `model` (see the module docstring)."""

    def __init__(self, model: SlotModel, max_queue: int = 64, max_num_tokens: int | None = None,
                 device: torch.device | str | None = None, vocab_limit: int | None = None,
                 on_step_end: Callable[[], None] | None = None, max_kv_tokens: int | None = None,
                 tokens_per_block: int = TOKENS_PER_BLOCK, kv_cache_reuse: bool = False, max_beam_width: int = 1,
                 overlap: bool | None = None):
        """`device`: where tokens are chosen (None: the model's, else the CPU). `max_num_tokens`: tokens of one step
        (None: max_seq_len). `max_kv_tokens`: what the KV cache holds, in blocks of `tokens_per_block` (None: every
        slot's whole length). `vocab_limit`: ids at or above it (the padding of an engine's vocabulary past its
        tokenizer's) are never chosen. `on_step_end` is called after every step, on the step's thread (to send a
        step's outputs together). `max_beam_width`: the widest beam search taken (each beam takes a slot). `overlap`
        (None: on a GPU): each step's tokens are handed out while the next step runs (see `step`)."""
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, not {max_queue}")
        for name, value in (("max_num_tokens", max_num_tokens), ("max_kv_tokens", max_kv_tokens),
                            ("tokens_per_block", tokens_per_block)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be >= 1, not {value}")
        if not 1 <= max_beam_width <= model.num_slots:
            raise UsageError(f"max_beam_width must be 1 to the {model.num_slots} slots, not {max_beam_width}")
        self.model = model
        self.scheduler = Scheduler(model, model.num_slots, shared_kv_blocks(model, max_kv_tokens, tokens_per_block),
                                   tokens_per_block, max_queue, kv_cache_reuse)
        self.vocab_limit = min(vocab_limit or model.vocab_size, model.vocab_size)
        self.device = torch.device(device if device is not None else getattr(model, "device", "cpu"))
        self.chooser = TokenChooser(model.num_slots, self.vocab_limit, self.device)
        if self.device.type == "cuda":
            self.chooser.warm_up()
        self.in_flight: LaunchedPass | None = None  # the pass launched last, whose tokens are not handed out yet
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.max_num_tokens = max_num_tokens or model.max_seq_len
        self.max_beam_width = max_beam_width
        self.on_step_end = on_step_end
        self._lock = threading.Condition()  # guards the scheduler's queue, which submitters write
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
        sequence = SequenceState(Handle(next(self._numbers)), fitted(request, self.model.max_seq_len), on_output,
                                 is_cancelled)
        with self._lock:
            if self._stopping or self._failed:
                raise ExecutorStopped(self._failed or "the executor is stopping")
            try:
                self.scheduler.submit(sequence)
            except QueueFullError:
                self._stats.count_rejected()
                raise
            self._lock.notify_all()
        return sequence.handle

    def check(self, request: Request) -> None:
        """UsageError when `request` cannot be served by this model, or would never fit its KV cache."""
        check_request(request, self.model.vocab_size, self.model.max_seq_len, self.max_beam_width)
        self.scheduler.check(fitted(request, self.model.max_seq_len))

    def stats(self) -> ExecutorStats:
        """The counters, and the queue, slots and KV-cache blocks now. Blocks kept for a finished request's prompt
        (prefix reuse) count as free: the next request that needs them takes them."""
        with self._lock:  # the step's thread changes slots and blocks outside it: read copies
            scheduler, running = self.scheduler, list(self.scheduler.running.values())
            used = scheduler.kv_blocks - scheduler.free_kv_blocks - sum(list(scheduler.retained.values()))
            return ExecutorStats(**{**self._stats.__dict__, "queued": len(scheduler.waiting), "active": len(running),
                                    "prefilling": sum(1 for s in running if s.unprefilled),
                                    "slots": scheduler.num_slots, "kv_blocks": scheduler.kv_blocks,
                                    "kv_blocks_used": used, "tokens_per_block": scheduler.tokens_per_block})

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
            return self.scheduler.has_work() or self.in_flight is not None

    def _loop(self) -> None:
        if self.device.type == "cuda":  # a new thread starts on GPU 0; the model's kernels launch on the current GPU
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                while not (self._stopping or self.scheduler.has_work() or self.in_flight is not None):
                    self._lock.wait()
                if self._stopping:
                    break
            self.step()
        self._abort("the server is shutting down")

    def step(self) -> None:
        """One step (the module docstring's):

        1. drop the cancelled requests;
        2. plan the step: the running requests' decode tokens and as many prompt tokens as the budget leaves;
        3. launch its forward pass and token choice;
        4. hand out chosen tokens: not overlapped, this pass's, once it has run; overlapped, the pass before's, while
           this one runs.
        """
        started = time.perf_counter()
        completed = decode_only = False
        try:
            self._drop_cancelled()
            with self._lock:
                overlapped = self.overlap and not self.scheduler.host_bound()
            decode_only = self._overlapped_step() if overlapped else self._step_in_turn()
            completed = True
        except Exception as e:
            log.exception("the model failed")
            self._recover(e)
        self._stats.count_step(int(1e6 * (time.perf_counter() - started)), completed, decode_only)
        if self.on_step_end is not None:
            self.on_step_end()

    def _step_in_turn(self) -> bool:
        """Not overlapped: what an overlapped step left in flight is handed out first, then this step's pass is
        launched and its tokens handed out. Whether it ran decode tokens alone."""
        self._hand_out(self._take_in_flight())
        launched = self._launch(self._plan())
        self._hand_out(launched)
        return launched is not None and launched.decode_only

    def _overlapped_step(self) -> bool:
        """Overlapped: this step's pass is launched, then the tokens of the pass before are handed out while it runs.
        Whether both ran decode tokens alone (the served decode step)."""
        launched = self._launch(self._plan())
        before, self.in_flight = self.in_flight, launched
        self._hand_out(before)
        return launched is not None and launched.decode_only and before is not None and before.decode_only

    def _take_in_flight(self) -> LaunchedPass | None:
        launched, self.in_flight = self.in_flight, None
        return launched

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        ask = now - self._last_cancel_check >= CANCEL_CHECK_S
        if ask:
            self._last_cancel_check = now
        for sequence in self.scheduler.cancelled_running(ask):  # only this thread changes what runs
            self._finish(sequence, Output([], finished=True, reason="cancelled"))
        with self._lock:
            cancelled = self.scheduler.take_cancelled_waiting(ask)
        for sequence in cancelled:
            self._finish(sequence, Output([], finished=True, reason="cancelled"))

    def _plan(self) -> StepPlan:
        """The scheduler's plan; the token chooser takes the settings of the requests it admits."""
        with self._lock:
            plan = self.scheduler.schedule(self.max_num_tokens)
        for sequence in plan.admitted:
            if sequence.beams is None:
                self.chooser.admit(sequence.slot, sequence.request, sequence.history)
        self._stats.count_admitted(plan.reused_tokens)
        return plan

    # --- a step's pass ----------------------------------------------------------------------------

    def _launch(self, plan: StepPlan) -> LaunchedPass | None:
        """One pass of the plan's decode tokens (a beam search's: one per beam) and prompt chunks, and the token choice
        of the requests whose prompt it completes; None when nothing was left to run. Chunks of requests that ask for
        their context logits run on their own first, keeping the logits of every position."""
        chunks = []
        for sequence, length in plan.chunks:
            if sequence.context_rows is not None:
                self._prefill_keeping_logits(sequence, length)
            else:
                chunks.append((sequence, length))
        return self._pass(plan.decoding, chunks) if plan.decoding or chunks else None

    def _prefill_keeping_logits(self, sequence: SequenceState, length: int) -> None:
        logits = self.model.prefill_all(sequence.slot, sequence.next_chunk(length), sequence.prefilled)
        sequence.context_rows.append(logits.float().cpu().numpy())
        self._passed([], [(sequence, length)])
        if not sequence.unprefilled:
            self._hand_out(self._take_rows([sequence], logits[-1:], [1]))  # host-bound: the step is not overlapped

    def _passed(self, decoding: list[SequenceState], chunks: list[tuple[SequenceState, int]]) -> None:
        """A pass of `decoding`'s tokens and `chunks` is on its way: counted, and the prompts' progress recorded."""
        self._stats.count_pass(len(decoding), len(chunks), sum(length for _, length in chunks))
        for sequence, length in chunks:
            self.scheduler.prefilled(sequence, length)

    def _pass(self, decoding: list[SequenceState], chunks: list[tuple[SequenceState, int]]) -> LaunchedPass | None:
        decode_rows = [row for s in decoding for row in s.decode_rows()]
        slots = [slot for slot, _ in decode_rows] + [s.slot for s, _ in chunks]
        starts = [position for _, position in decode_rows] + [s.prefilled for s, _ in chunks]
        prompts = [s.next_chunk(length) for s, length in chunks]
        decode_ids = self.chooser.last_tokens[upload(slots[:len(decode_rows)], self.device)] if decode_rows else None
        # Decode tokens alone and prompts alone go through decode and prefill, which the fast runtime replays as
        # CUDA graphs of their own (a decode batch, a lone prompt).
        if not chunks:
            logits = self.model.decode(slots, decode_ids)
        elif not decoding:
            logits = self.model.prefill(slots, prompts, starts)
        else:
            logits = self.model.step(slots, [None] * len(decode_rows) + prompts, starts, decode_ids=decode_ids)
        self._passed(decoding, chunks)
        complete = [i for i, (s, _) in enumerate(chunks) if not s.unprefilled]
        rows = list(range(len(decode_rows))) + [len(decode_rows) + i for i in complete]
        if rows and len(rows) < len(slots):
            logits = logits.index_select(0, upload(rows, logits.device))
        widths = [s.request.sampling.beam_width for s in decoding] + [1] * len(complete)
        launched = self._take_rows(decoding + [chunks[i][0] for i in complete], logits, widths)
        if launched is not None:
            launched.decode_only = not chunks
        return launched

    def _take_rows(self, sequences: list[SequenceState], logits: torch.Tensor, widths: list[int]
                   ) -> LaunchedPass | None:
        """Each sequence's next token from its `widths[i]` rows of `logits` (a beam search's: one per beam, one
        before its first step): a beam search's chosen now, the others' launched in one pass of the token chooser
        (the pass to hand out)."""
        firsts = list(itertools.accumulate(widths, initial=0))
        plain = [i for i, s in enumerate(sequences) if s.beams is None]
        for i in plain:
            if sequences[i].request.output.return_generation_logits:
                sequences[i].step_logits = logits[firsts[i]].float().cpu().numpy()
        launched = None
        if plain:
            rows = logits if len(plain) == len(logits) else \
                logits.index_select(0, upload([firsts[i] for i in plain], logits.device))
            chosen = [sequences[i] for i in plain]
            for sequence in chosen:
                sequence.pending += 1
            launched = LaunchedPass(chosen, self.chooser.choose_later([s.slot for s in chosen], rows))
        for i, sequence in enumerate(sequences):
            if sequence.beams is not None:
                self._beam_step(sequence, logits[firsts[i]:firsts[i + 1]])
        return launched

    def _beam_step(self, sequence: SequenceState, logits: torch.Tensor) -> None:
        beams = sequence.beams
        try:
            parents = beams.step(logits, sequence.history, self.vocab_limit)
        except Exception as e:
            log.warning("request %d: %s", sequence.handle.id, e)
            self._finish(sequence, Output([], finished=True, reason="error", error=f"no next beam could be chosen: {e}"))
            return
        self._stats.count_generated()
        if beams.done:
            self._finish(sequence, beams.output())
            return
        sources, targets = beams.follow(parents)
        if sources:
            self.model.copy(sources, targets)
        self.chooser.set_last_tokens(beams.slots, beams.last_tokens())

    # --- handing out ------------------------------------------------------------------------------

    def _hand_out(self, launched: LaunchedPass | None) -> None:
        """The tokens of a launched pass to their requests (those still running); a row whose settings left nothing
        to choose ends its request alone, with the error."""
        if launched is None:
            return
        tokens, log_probs, errors = launched.chosen.result()
        for sequence, token, log_prob, error in zip(launched.sequences, tokens, log_probs, errors, strict=True):
            sequence.pending -= 1
            if sequence.handle.done.is_set():
                continue  # cancelled, or ended by the token before (this one is never sent)
            if error is not None:
                log.warning("request %d: %s", sequence.handle.id, error)
                self._finish(sequence, Output([], finished=True, reason="error",
                                              error=f"no next token could be chosen: {error}"))
            else:
                self._advance(sequence, token, log_prob)

    def _advance(self, sequence: SequenceState, token: int, log_prob: float) -> None:
        reason = sequence.take(token)
        if reason == "end_id":
            self._finish(sequence, Output([], finished=True, reason=reason))
            return
        self._stats.count_generated()
        output = Output([token], [log_prob] if sequence.request.output.return_log_probs else [],
                        finished=reason is not None, reason=reason,
                        generation_logits=None if sequence.step_logits is None else sequence.step_logits[None])
        if reason is not None:
            self._finish(sequence, output)
        elif not sequence.deliver(output, self.scheduler.tokens_per_block):
            self._finish(sequence, Output([], finished=True, reason="cancelled"))

    def _finish(self, sequence: SequenceState, output: Output) -> None:
        if self.scheduler.release(sequence):
            self.chooser.release(sequence.slot)
        self._stats.count_end(output.reason)
        sequence.deliver(output, self.scheduler.tokens_per_block)
        sequence.handle.done.set()

    # --- failures ----------------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        """The model raised: end the running requests with the error and free every slot; if even that
        fails, the executor takes no more requests."""
        message = f"the model failed: {type(error).__name__}: {error}"
        self.in_flight = None
        running = self.scheduler.forget_all()  # a failed pass may have left any slot's positions half written
        self.chooser.release_all()
        self._fail(running, message)
        try:
            for slot in range(self.model.num_slots):
                self.model.release(slot)
        except Exception:
            with self._lock:
                self._failed = message
            self._abort(message)

    def _abort(self, message: str) -> None:
        """End every queued and running request with `message`."""
        with self._lock:
            self.in_flight = None
            waiting = self.scheduler.drain()
            running = self.scheduler.forget_all()
            self.chooser.release_all()
        self._fail(waiting + running, message)

    def _fail(self, sequences: list[SequenceState], message: str) -> None:
        for sequence in sequences:
            sequence.deliver(Output([], finished=True, reason="error", error=message), self.scheduler.tokens_per_block)
            sequence.handle.done.set()
