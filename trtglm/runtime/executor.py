"""In-flight batching over a `SlotModel` (trtglm.runtime.slots): requests join and leave the running
batch at every step.

Requests wait in a bounded queue (a full queue refuses new ones with `QueueFullError`). Each
step of the executor is one forward pass under a token budget, `max_num_tokens` (TensorRT-LLM's
name: tokens of one engine step across the batch):

1. drops cancelled requests, queued, prefilling or running (their slots are released at once);
2. takes one decode token of every running request (a request whose prompt is complete): they
   always go, so prompts never stall decoding;
3. fills what is left of the budget (at least one token, so decoding never starves prompts)
   with prompt tokens, oldest request first: the next chunks of the prompts already under
   way, then the prompts of queued requests, admitted in arrival order while a slot is free,
   the KV cache has room for the request's whole length (prompt + output, reserved at
   admission as TensorRT-LLM's `guaranteed_no_evict` policy does) and budget is left. A request
   that does not fit waits in the queue (it is not refused) until a finished one frees room. A
   prompt longer than what is left is prefilled in chunks over several steps, holding its slot
   meanwhile; the request gets its first token from its last chunk;
4. runs it all as one forward pass (`SlotModel.step`); a step of decode tokens only is a
   `decode`, and one of prompt tokens only a `prefill` (the fast runtime replays CUDA graphs for
   a decode batch, a lone prompt and a mixed step of a few hundred tokens);
5. chooses every row's token on the device (step 4 and 5 are queued, not waited for), then hands
   out the tokens a step chose: stop checks, outputs, finished requests' slots freed.

Chunks give the tokens one prefill gives (each chunk continues its slot's cache), and a mixed
pass the tokens separate passes give.

Overlapped (on a GPU, `overlap`), step 5 hands out the tokens of the step before, while this
step's pass runs: the host never waits for a pass it could prepare the next one during. A running
request's input is its newest token where the chooser left it (`TokenChooser.last_tokens`), so
nothing needs the previous step's results on the host; a request whose last token is already on
the way is not scheduled again, and one that ends (end id, stop word, cancel) may run one more
token that is never sent. Requests whose choice needs the host (beam search, logits asked for,
bad words longer than one token) make the steps run in turn while they are there.

With `kv_cache_reuse` (TensorRT-LLM's `enable_kv_cache_reuse`), a new request's prompt starts after the
longest prefix of whole blocks that some slot's cache holds (admission.py says how).

Each new token goes to its request's callback as an `Output` (the new tokens, their log
probabilities, whether it is finished and why). A request finishes at `end_id` (which is not
returned), after a stop word (which is returned, as TensorRT-LLM returns it), after
`max_new_tokens`, or when cancelled. Tokens are chosen by TensorRT-LLM's rules, every row of a
step in one batched pass on the model's device with one host transfer (sampling.TokenChooser,
which takes each request's settings into its slot at admission: embedding bias, penalties, bad
words, `end_id` and one-token stop words banned before `min_tokens`, then greedy or the request's
own seeded temperature / top-k / top-p sampling, and log probabilities of the distribution the
token was chosen from).

Logits, as TensorRT-LLM returns them (float32, the model's whole padded vocabulary), only for a
request that asks (`OutputConfig`): context logits run its prompt chunks on their own (`SlotModel.prefill_all`,
never from the prefix cache) keeping every position's logits, which its first Output carries;
generation logits give each Output the raw logits (before bias, penalties, bans and
temperature) each of its tokens was chosen from (a beam search: each beam's, `Beam.logits`).
Other requests' passes are unchanged.

A beam search (`SamplingConfig.beam_width` > 1, beams.py) takes `beam_width` slots at admission, and KV-cache
room for `beam_width` whole lengths (each beam's slot holds the prompt and its own output). Its
prompt is prefilled into its first slot (reusing a cached prefix as any request's does: every
beam's slot holds the same prompt, so the first slot's prompt blocks stay valid whichever beams
survive), then each step's pass takes one decode token per beam beside the other requests'
tokens and chunks; a beam that continues another takes a copy of that one's slot
(`SlotModel.copy`). It answers once, when the search ends, with every beam (`Output.beams`,
best first).

`step()` runs one step on the calling thread (tests drive it so); `start()` runs steps on a
background thread whenever there is work. The types a caller hands in and gets back (`Request`,
`Output`, `Handle`, the errors, `ExecutorStats`) and the request checks are in request.py; a
request's state in the executor in sequence.py, its admission into slots and the KV cache in
admission.py, and what happens to a chosen token in hand_out.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from trtglm.errors import UsageError
from trtglm.conventions import TOKENS_PER_BLOCK
from trtglm.runtime.admission import Admission, shared_kv_blocks
from trtglm.runtime.beams import continued_slots
from trtglm.runtime.hand_out import HandOut, LaunchedPass
from trtglm.runtime.prefix import PrefixIndex
from trtglm.runtime.request import (ExecutorStats, ExecutorStopped, Handle, Output, OutputCallback, QueueFullError,
                                    Request, check_request, fitted)
from trtglm.runtime.sampling import TokenChooser
from trtglm.runtime.sequence import SequenceState
from trtglm.runtime.slots import SlotModel
from trtglm.runtime.transfer import upload

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.05  # how often running requests' `is_cancelled` is asked (it may be a remote call)


class Executor(Admission, HandOut):
    """In-flight batching of `Request`s over `model` (see the module docstring)."""

    def __init__(self, model: SlotModel, max_queue: int = 64, max_num_tokens: int | None = None,
                 device: torch.device | str | None = None, vocab_limit: int | None = None,
                 on_step_end: Callable[[], None] | None = None, max_kv_tokens: int | None = None,
                 tokens_per_block: int = TOKENS_PER_BLOCK, kv_cache_reuse: bool = False, max_beam_width: int = 1,
                 overlap: bool | None = None):
        """`device`: where tokens are chosen (None: the model's, else the CPU). `max_num_tokens`: tokens of one step
        (None: max_seq_len). `max_kv_tokens`: what the KV cache holds,
        in blocks of `tokens_per_block` (None: every slot's whole length). `vocab_limit`: ids at or above it (the
        padding of an engine's vocabulary past its tokenizer's) are never chosen. `on_step_end` is called after
        every step, on the step's thread (to send a step's outputs together). `max_beam_width`: the widest beam
        search taken (each beam takes a slot). `overlap` (None: on a GPU): each step's tokens are handed out while the
        next step runs (see `step`)."""
        if max_queue < 0:
            raise UsageError(f"max_queue must be >= 0, not {max_queue}")
        for name, value in (("max_num_tokens", max_num_tokens), ("max_kv_tokens", max_kv_tokens),
                            ("tokens_per_block", tokens_per_block)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be >= 1, not {value}")
        if not 1 <= max_beam_width <= model.max_batch:
            raise UsageError(f"max_beam_width must be 1 to the {model.max_batch} slots, not {max_beam_width}")
        self.model = model
        self.on_step_end = on_step_end
        self.max_beam_width = max_beam_width
        self.max_queue = max_queue
        self.max_num_tokens = max_num_tokens or model.max_seq_len
        self.tokens_per_block = tokens_per_block
        self.kv_blocks = shared_kv_blocks(model, max_kv_tokens, tokens_per_block)
        self._free_kv_blocks = self.kv_blocks
        self._retained: dict[int, int] = {}  # free slot -> blocks its cached prompt keeps, least recently released first
        self.prefixes = PrefixIndex(tokens_per_block, model.max_batch) if kv_cache_reuse else None
        self.vocab_limit = min(vocab_limit or model.vocab_size, model.vocab_size)
        self.device = torch.device(device if device is not None else getattr(model, "device", "cpu"))
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: LaunchedPass | None = None  # the pass launched last, whose tokens are not handed out yet
        self.chooser = TokenChooser(model.max_batch, self.vocab_limit, self.device)
        if self.device.type == "cuda":
            self.chooser.warm_up()
        self._lock = threading.Condition()
        self._queue: deque[SequenceState] = deque()
        self._active: dict[int, SequenceState] = {}  # slot -> sequence
        self._held: dict[int, SequenceState] = {}  # a beam search's other slots -> its sequence
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
        sequence = SequenceState(handle, request, on_output, is_cancelled)
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
        """UsageError when `request` cannot be served by this model, or would never fit its KV cache."""
        check_request(request, self.model.vocab_size, self.model.max_seq_len, self.max_beam_width)
        blocks = self._blocks_for(fitted(request, self.model.max_seq_len))
        if blocks > self.kv_blocks:
            raise UsageError(f"the request needs {blocks * self.tokens_per_block} KV-cache positions (prompt and "
                             f"output, for each beam); the cache holds {self.kv_blocks * self.tokens_per_block}")

    def stats(self) -> ExecutorStats:
        """The counters, and the queue, slots and KV-cache blocks now. Blocks kept for a finished request's prompt
        (prefix reuse) count as free: the next request that needs them takes them."""
        with self._lock:  # the step's thread changes slots and blocks outside it: read copies
            used = self.kv_blocks - self._free_kv_blocks - sum(list(self._retained.values()))
            running = list(self._active.values())
            return ExecutorStats(**{**self._stats.__dict__, "queued": len(self._queue), "active": len(running),
                                    "prefilling": sum(1 for s in running if s.unprefilled),
                                    "slots": self.model.max_batch, "kv_blocks": self.kv_blocks,
                                    "kv_blocks_used": used, "tokens_per_block": self.tokens_per_block})

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
            return bool(self._queue or self._active or self._in_flight)

    def _loop(self) -> None:
        if self.device.type == "cuda":  # a new thread starts on GPU 0; the model's kernels launch on the current GPU
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                while not (self._stopping or self._queue or self._active or self._in_flight):
                    self._lock.wait()
                if self._stopping:
                    break
            self.step()
        self._abort("the server is shutting down")

    def step(self) -> None:
        """One step: drop cancelled requests, launch one forward pass of the running requests' decode tokens and
        as many prompt tokens as the budget leaves, and hand out the tokens the pass chose (overlapped: those of
        the pass before, see the module docstring)."""
        started = time.perf_counter()
        decode_only = False
        try:
            self._drop_cancelled()
            overlap = self.overlap and not self._host_bound()
            if not overlap:
                self._hand_out_in_flight()
            before = self._in_flight
            launched = self._launch()
            self._hand_out_in_flight()
            self._in_flight = launched
            if not overlap:
                self._hand_out_in_flight()
            self._stats.steps += 1
            decode_only = launched is not None and launched.decode_only and \
                (not overlap or before is not None and before.decode_only)
        except Exception as e:
            log.exception("the model failed")
            self._recover(e)
        took_us = int(1e6 * (time.perf_counter() - started))
        self._stats.step_us += took_us
        if decode_only:
            self._stats.decode_only_steps += 1
            self._stats.decode_only_us += took_us
        if self.on_step_end is not None:
            self.on_step_end()

    def _launch(self) -> LaunchedPass | None:
        """The step's forward pass and token choice, queued on the model's device."""
        decoding = sorted((s for s in self._active.values() if s.decodes), key=lambda s: s.handle.id)
        decode_tokens = sum(s.request.sampling.beam_width for s in decoding)
        chunks = self._plan_prefill(max(1, self.max_num_tokens - decode_tokens))
        return self._forward(decoding, chunks) if decoding or chunks else None

    def _host_bound(self) -> bool:
        with self._lock:
            return any(s.host_bound for s in (*self._active.values(), *self._queue))

    def _hand_out_in_flight(self) -> None:
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._hand_out(launched)

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

    # --- a step's pass ----------------------------------------------------------------------------

    def _forward(self, decoding: list[SequenceState], chunks: list[tuple[SequenceState, int]]
                 ) -> LaunchedPass | None:
        """One pass of the decode tokens (a beam search's: one per beam) and the prompt chunks; the requests whose
        prompt it completes get their first token. Chunks of requests that ask for their context logits run
        on their own first, keeping the logits of every position."""
        for sequence, length in [(s, n) for s, n in chunks if s.context_rows is not None]:
            self._prefill_keeping_logits(sequence, length)
        chunks = [(s, n) for s, n in chunks if s.context_rows is None]
        return self._pass(decoding, chunks) if decoding or chunks else None

    def _prefill_keeping_logits(self, sequence: SequenceState, length: int) -> None:
        logits = self.model.prefill_all(sequence.slot, sequence.next_chunk(length), sequence.prefilled)
        sequence.context_rows.append(logits.float().cpu().numpy())
        self._stats.prefill_calls += 1
        self._chunk_done(sequence, length)
        if not sequence.unprefilled:
            chosen = self._take_rows([sequence], logits[-1:], [1])
            if chosen is not None:  # its request is host-bound: the step is not overlapped
                self._hand_out(chosen)

    def _chunk_done(self, sequence: SequenceState, length: int) -> None:
        sequence.prefilled += length
        self._stats.prefill_tokens += length
        self._stats.prefill_chunks += 1
        if self.prefixes is not None:
            self.prefixes.holds(sequence.slot, sequence.request.prompt, sequence.prefilled)

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
        self._stats.prefill_calls += bool(chunks)
        self._stats.decode_calls += bool(decoding)
        self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(decoding))
        for sequence, length in chunks:
            self._chunk_done(sequence, length)
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
        before its first step): a beam search's chosen now, the others' launched (the pass to hand out)."""
        firsts = list(itertools.accumulate(widths, initial=0))
        plain = [i for i, s in enumerate(sequences) if s.beams is None]
        for i in plain:
            if sequences[i].request.output.return_generation_logits:
                sequences[i].step_logits = logits[firsts[i]].float().cpu().numpy()
        launched = None
        if plain:
            rows = logits if len(plain) == len(logits) else \
                logits.index_select(0, upload([firsts[i] for i in plain], logits.device))
            launched = self._choose_later([sequences[i] for i in plain], rows)
        for i, sequence in enumerate(sequences):
            if sequence.beams is not None:
                self._beam_step(sequence, logits[firsts[i]:firsts[i + 1]])
        return launched

    def _beam_step(self, sequence: SequenceState, logits: torch.Tensor) -> None:
        try:
            parents = sequence.beam_step(logits, self.vocab_limit)
        except Exception as e:
            log.warning("request %d: %s", sequence.handle.id, e)
            error = f"no next beam could be chosen: {e}"
            self._finish(sequence, Output([], finished=True, reason="error", error=error))
            return
        self._stats.generated_tokens += 1
        if sequence.beams.done:
            self._finish(sequence, sequence.beam_output())
            return
        sequence.beam_slots, sources, targets = continued_slots(sequence.beam_slots, parents)
        if sources:
            self.model.copy(sources, targets)
        self.chooser.set_last_tokens(sequence.beam_slots, [tokens[-1] for tokens in sequence.beams.running])

    def _choose_later(self, sequences: list[SequenceState], logits: torch.Tensor) -> LaunchedPass:
        """Each sequence's next token from its row of `logits`, all in one pass (sampling.TokenChooser), launched:
        `_hand_out` gives them to their requests."""
        for sequence in sequences:
            sequence.pending += 1
        return LaunchedPass(sequences, self.chooser.choose_later([s.slot for s in sequences], logits))

    # --- failures ----------------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        """The model raised: end the running requests with the error and free every slot; if even that
        fails, the executor takes no more requests."""
        message = f"the model failed: {type(error).__name__}: {error}"
        self._in_flight = None
        running = list(self._active.values())
        self._forget_slots()
        if self.prefixes is not None:
            self.prefixes.clear()  # a failed pass may have left any slot's positions half written
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
            self._in_flight = None
            self._queue.clear()
            self._forget_slots()
        for sequence in sequences:
            self._deliver(sequence, Output([], finished=True, reason="error", error=message))
            sequence.handle.done.set()
