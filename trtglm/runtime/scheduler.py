"""`Scheduler`: what each step of the executor (executor.py) runs, and the slots and KV-cache blocks that requests
hold meanwhile.

It owns the waiting queue, the running sequences (slot -> sequence, a beam search's other slots held beside), the
account of KV-cache blocks and the prefix index. `schedule(budget)` plans one step of at most `budget` tokens:

1. one decode token of every running request whose prompt is in (a beam search: one per beam): they always go, so
   prompts never stall decoding;
2. what is left of the budget (at least one token, so decoding never starves prompts) in prompt tokens, oldest
   request first: the next chunks of the prompts under way, then the prompts of queued requests, admitted in arrival
   order while a slot is free, the KV cache has room for the request's whole length (prompt + output, reserved at
   admission as TensorRT-LLM's `guaranteed_no_evict` policy does) and budget is left. A request that does not fit
   waits in the queue (it is not refused) until a finished one frees room. A prompt longer than what is left is
   prefilled in chunks over several steps, holding its slot meanwhile.

With `kv_cache_reuse` (TensorRT-LLM's `enable_kv_cache_reuse`), a new request's prompt is looked up block by block
(`tokens_per_block`) in the prefix index (prefix.py): the longest prefix of whole blocks that some slot's cache holds
is copied into its slot (or kept, when its slot is the one that holds it) instead of computed, and prefilling starts
after it. A finished request's slot keeps its prompt's whole blocks for this (`SlotModel.release(slot, keep)`); they
count against the KV cache until a request that needs the room evicts them, least recently released first.

A beam search takes `beam_width` slots at admission (its prompt goes into the first; the others are held for its
beams) and KV-cache room for `beam_width` whole lengths.

The scheduler changes the slots' caches only through `cache` (the model: `reuse` and `release`). It is not
thread-safe: the executor calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from trtglm.errors import UsageError
from trtglm.runtime.prefix import PrefixIndex
from trtglm.runtime.request import QueueFullError, Request
from trtglm.runtime.sequence import SequenceState
from trtglm.runtime.slots import SlotModel


@dataclass
class StepPlan:
    """What one step runs."""

    decoding: list[SequenceState] = field(default_factory=list)  # a decode token each (a beam search: one a beam)
    chunks: list[tuple[SequenceState, int]] = field(default_factory=list)  # (sequence, prompt tokens), oldest first
    admitted: list[SequenceState] = field(default_factory=list)  # taken from the queue into slots for this step
    reused_tokens: int = 0  # prompt tokens the admitted found in the prefix cache

    @property
    def decode_tokens(self) -> int:
        return sum(s.request.sampling.beam_width for s in self.decoding)

    @property
    def prompt_tokens(self) -> int:
        return sum(length for _, length in self.chunks)


def shared_kv_blocks(model: SlotModel, max_kv_tokens: int | None, tokens_per_block: int) -> int:
    """The KV-cache blocks of `tokens_per_block` positions the scheduler shares out: what `max_kv_tokens` asks (None:
    all), at most what the model's cache holds. A paged cache (one with a `block_size`) is counted in whole blocks
    of both sizes, so that a request's reservation always covers the blocks its positions take there."""
    block_size = getattr(model, "block_size", None)
    if block_size is not None and tokens_per_block % block_size:
        raise UsageError(f"tokens_per_block ({tokens_per_block}) must be a multiple of the model's KV-cache block "
                         f"({block_size} positions)")
    held = model.kv_tokens // tokens_per_block if block_size else -(-model.kv_tokens // tokens_per_block)
    return min(held, -(-max_kv_tokens // tokens_per_block)) if max_kv_tokens else held


class Scheduler:
    """The queue, the slots of `cache` (`num_slots`) and its `kv_blocks` blocks of `tokens_per_block` positions (see
    the module docstring). `max_queue`: requests that may wait."""

    def __init__(self, cache: SlotModel, num_slots: int, kv_blocks: int, tokens_per_block: int, max_queue: int,
                 kv_cache_reuse: bool = False):
        self.cache, self.num_slots, self.kv_blocks, self.tokens_per_block = cache, num_slots, kv_blocks, tokens_per_block
        self.max_queue = max_queue
        self.waiting: deque[SequenceState] = deque()
        self.running: dict[int, SequenceState] = {}  # slot -> sequence
        self.held: dict[int, SequenceState] = {}  # a beam search's other slots -> its sequence
        self.free_kv_blocks = kv_blocks
        self.retained: dict[int, int] = {}  # free slot -> blocks its cached prompt keeps, least recently released first
        self.prefixes = PrefixIndex(tokens_per_block, num_slots) if kv_cache_reuse else None

    # --- taking requests --------------------------------------------------------------------------------------

    def blocks_for(self, request: Request) -> int:
        """The KV-cache blocks `request` reserves: its whole length, for each beam."""
        return request.sampling.beam_width * -(-(len(request.prompt) + request.max_tokens) // self.tokens_per_block)

    def check(self, request: Request) -> None:
        """UsageError when `request` would never fit the KV cache."""
        blocks = self.blocks_for(request)
        if blocks > self.kv_blocks:
            raise UsageError(f"the request needs {blocks * self.tokens_per_block} KV-cache positions (prompt and "
                             f"output, for each beam); the cache holds {self.kv_blocks * self.tokens_per_block}")

    def submit(self, sequence: SequenceState) -> None:
        """Queue `sequence`; QueueFullError when `max_queue` already wait."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"busy: {len(self.waiting)} requests already wait for the {self.num_slots} slots "
                                 "(the queue is full); retry later")
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def host_bound(self) -> bool:
        """Whether a waiting or running request needs its tokens on the host before its next step (see
        `SequenceState.host_bound`)."""
        return any(s.host_bound for s in (*self.running.values(), *self.waiting))

    def cancelled_running(self, ask: bool) -> list[SequenceState]:
        """The running requests that want to be cancelled (`ask`: their `is_cancelled` asked too); ending them
        releases them."""
        return [s for s in self.running.values() if s.wants_cancel(ask)]

    def take_cancelled_waiting(self, ask: bool) -> list[SequenceState]:
        """The waiting requests that want to be cancelled, taken out of the queue."""
        cancelled = [s for s in self.waiting if s.wants_cancel(ask)]
        for sequence in cancelled:
            self.waiting.remove(sequence)
        return cancelled

    # --- planning a step --------------------------------------------------------------------------------------

    def schedule(self, budget: int) -> StepPlan:
        """The next step within `budget` tokens (steps 1 and 2 of the module docstring)."""
        plan = StepPlan(sorted((s for s in self.running.values() if s.decodes), key=lambda s: s.handle.id))
        budget = max(1, budget - plan.decode_tokens)
        under_way = sorted((s for s in self.running.values() if s.unprefilled), key=lambda s: s.handle.id)
        self._admit(plan, budget - sum(s.unprefilled for s in under_way))
        for sequence in under_way + plan.admitted:
            length = min(sequence.unprefilled, budget)
            if not length:
                break
            plan.chunks.append((sequence, length))
            budget -= length
        return plan

    def prefilled(self, sequence: SequenceState, length: int) -> None:
        """`length` more of `sequence`'s prompt are in its slot's cache (with prefix caching, its whole blocks are
        offered to later prompts)."""
        sequence.prefilled += length
        if self.prefixes is not None:
            self.prefixes.holds(sequence.slot, sequence.request.prompt, sequence.prefilled)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Queued requests, in arrival order, into free slots while the KV cache has room for them and `budget`
        prompt tokens are left (the last admitted may start with a chunk of its prompt)."""
        while self.waiting and budget > 0 and len(self._free_slots()) >= self.waiting[0].request.sampling.beam_width:
            sequence = self.waiting[0]
            blocks = self.blocks_for(sequence.request)
            if blocks > self.free_kv_blocks + sum(self.retained.values()):
                break  # it waits (as everyone after it does) until finished requests free the cache
            self._evict(blocks)
            self.waiting.popleft()
            self.free_kv_blocks -= blocks
            sequence.kv_blocks = blocks
            plan.reused_tokens += self._place(sequence)
            sequence.scheduled_ns = time.time_ns()
            self._hold(sequence)
            plan.admitted.append(sequence)
            budget -= sequence.unprefilled

    def _evict(self, blocks: int) -> None:
        """Free cached prompts of finished requests, least recently released first, until `blocks` are free."""
        while self.free_kv_blocks < blocks:
            slot = next(iter(self.retained))
            self.free_kv_blocks += self.retained.pop(slot)
            self.prefixes.forget(slot)
            self.cache.release(slot)

    def _place(self, sequence: SequenceState) -> int:
        """Give `sequence` a free slot; with prefix caching, the one that holds the longest prefix of its prompt
        (or the least recently used, into which that prefix is copied from the slot that holds it). Returns the
        prompt tokens it found cached."""
        free = self._free_slots()
        sequence.reused_blocks = 0
        if self.prefixes is None:
            sequence.slot = free[0]
        else:
            self._place_reusing(sequence, free)
        self.running[sequence.slot] = sequence
        return sequence.prefilled

    def _place_reusing(self, sequence: SequenceState, free: list[int]) -> None:
        prompt = sequence.request.prompt
        # context logits need every prompt position computed
        match = None if sequence.context_rows is not None else self.prefixes.longest(prompt)
        sequence.slot = self.prefixes.choose_slot(free, match)
        kept = match.length if match is not None and sequence.slot in match.sources else 0
        self.prefixes.take(sequence.slot, kept)
        if sequence.slot in self.retained:  # what it kept beyond `kept` is freed; the rest is the new request's
            self.free_kv_blocks += self.retained.pop(sequence.slot)
            self.cache.release(sequence.slot, kept)
        if match is not None:
            self.cache.reuse(sequence.slot, sequence.slot if kept else min(match.sources), match.length)
            self.prefixes.holds(sequence.slot, prompt, match.length)
            sequence.prefilled = match.length
            sequence.reused_blocks = match.length // self.tokens_per_block

    def _hold(self, sequence: SequenceState) -> None:
        """A beam search's other slots (with prefix caching the least recently used, whose prefixes are
        forgotten: beams overwrite them)."""
        for _ in range(sequence.request.sampling.beam_width - 1):
            free = self._free_slots()
            slot = free[0] if self.prefixes is None else self.prefixes.choose_slot(free, None)
            if self.prefixes is not None:
                self.prefixes.take(slot, 0)
            sequence.held.append(slot)
            self.held[slot] = sequence
        if sequence.beams is not None:
            sequence.beams.slots = [sequence.slot, *sequence.held]

    def _free_slots(self) -> list[int]:
        return [slot for slot in range(self.num_slots) if slot not in self.running and slot not in self.held]

    # --- giving back ------------------------------------------------------------------------------------------

    def release(self, sequence: SequenceState) -> bool:
        """Give back the slots and KV-cache blocks of an ending sequence; False when it holds none (it never got a
        slot, or gave them back already). With prefix caching its slot keeps its prompt's whole blocks, retained
        until a request needs the room."""
        if sequence.slot is None or self.running.get(sequence.slot) is not sequence:
            return False
        del self.running[sequence.slot]
        keep = self.prefixes.cached(sequence.slot) if self.prefixes is not None else 0
        self.cache.release(sequence.slot, keep)
        retained = keep // self.tokens_per_block  # the prompt's whole blocks
        if retained:
            self.retained[sequence.slot] = retained
        self.free_kv_blocks += sequence.kv_blocks - retained
        for slot in sequence.held:
            del self.held[slot]
            self.cache.release(slot)
        return True

    def forget_all(self) -> list[SequenceState]:
        """Every slot free, every KV-cache block with it, every cached prefix forgotten (the caches' contents can no
        longer be trusted; the model's slots are not released here). Returns the sequences that were running."""
        running = list(self.running.values())
        self.running.clear()
        self.held.clear()
        self.free_kv_blocks = self.kv_blocks
        self.retained.clear()
        if self.prefixes is not None:
            self.prefixes.clear()
        return running

    def drain(self) -> list[SequenceState]:
        """Empty the queue; the sequences that waited."""
        waiting = list(self.waiting)
        self.waiting.clear()
        return waiting
