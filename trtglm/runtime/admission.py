"""`Admission`, a part of the `Executor` (executor.py): which queued requests start, into which slots, and the
KV-cache blocks they hold while they run. It keeps the executor's slot and block accounts: `_active` and `_held`
(slot -> sequence), `_free_kv_blocks` and `_retained`, and the prefix index `prefixes`.
Who is admitted when: step 3 of executor.py's docstring.

With `kv_cache_reuse` (TensorRT-LLM's `enable_kv_cache_reuse`), a new request's prompt is looked
up block by block (`tokens_per_block`) in the prefix index (prefix.py): the longest prefix of
whole blocks that some slot's cache holds is copied into its slot (or kept, when its slot is the
one that holds it) instead of computed, and prefilling starts after it. A finished request's slot
keeps its prompt's whole blocks for this (`SlotModel.release(slot, keep)`); they count against the
KV cache until a request that needs the room evicts them, least recently released first.
"""

from __future__ import annotations

import time

from trtglm.errors import UsageError
from trtglm.runtime.request import Request
from trtglm.runtime.sequence import SequenceState
from trtglm.runtime.slots import SlotModel


def shared_kv_blocks(model: SlotModel, max_kv_tokens: int | None, tokens_per_block: int) -> int:
    """The KV-cache blocks of `tokens_per_block` positions the executor shares out: what `max_kv_tokens` asks (None:
    all), at most what the model's cache holds. A paged cache (one with a `block_size`) is counted in whole blocks
    of both sizes, so that a request's reservation always covers the blocks its positions take there."""
    block_size = getattr(model, "block_size", None)
    if block_size is not None and tokens_per_block % block_size:
        raise UsageError(f"tokens_per_block ({tokens_per_block}) must be a multiple of the model's KV-cache block "
                         f"({block_size} positions)")
    held = model.kv_tokens // tokens_per_block if block_size else -(-model.kv_tokens // tokens_per_block)
    return min(held, -(-max_kv_tokens // tokens_per_block)) if max_kv_tokens else held


class Admission:
    """Slots and KV-cache blocks, taken at admission and given back when a request ends; the state it reads and
    writes is set up by `Executor.__init__`."""

    def _blocks_for(self, request: Request) -> int:
        return request.sampling.beam_width * -(-(len(request.prompt) + request.max_new_tokens) // self.tokens_per_block)


    def _plan_prefill(self, budget: int) -> list[tuple[SequenceState, int]]:
        """(sequence, chunk length) to prefill this step, within `budget` prompt tokens: prompts under way
        first (oldest first), then new requests admitted while budget is left."""
        under_way = sorted((s for s in self._active.values() if s.unprefilled), key=lambda s: s.handle.id)
        chunks = []
        for sequence in under_way + self._admit(budget - sum(s.unprefilled for s in under_way)):
            length = min(sequence.unprefilled, budget)
            if not length:
                break
            chunks.append((sequence, length))
            budget -= length
        return chunks

    def _admit(self, budget: int) -> list[SequenceState]:
        """Queued requests, in arrival order, into free slots while the KV cache has room for them and `budget`
        prompt tokens are left (the last admitted may start with a chunk of its prompt)."""
        admitted = []
        with self._lock:
            while self._queue and budget > 0 and len(self._free_slots()) >= self._queue[0].request.sampling.beam_width:
                sequence = self._queue[0]
                blocks = self._blocks_for(sequence.request)
                if blocks > self._free_kv_blocks + sum(self._retained.values()):
                    break  # it waits (as everyone after it does) until finished requests free the cache
                self._evict(blocks)
                self._queue.popleft()
                self._free_kv_blocks -= blocks
                sequence.kv_blocks = blocks
                self._place(sequence)
                if sequence.beams is None:
                    self.chooser.admit(sequence.slot, sequence.request, sequence.history)
                sequence.scheduled_ns = time.time_ns()
                self._hold(sequence)
                admitted.append(sequence)
                budget -= sequence.unprefilled
        return admitted

    def _evict(self, blocks: int) -> None:
        """Free cached prompts of finished requests, least recently released first, until `blocks` are free."""
        while self._free_kv_blocks < blocks:
            slot = next(iter(self._retained))
            self._free_kv_blocks += self._retained.pop(slot)
            self.prefixes.forget(slot)
            self.model.release(slot)

    def _place(self, sequence: SequenceState) -> None:
        """Give `sequence` a free slot; with prefix caching, the one that holds the longest prefix of its prompt
        (or the least recently used, into which that prefix is copied from the slot that holds it)."""
        free = self._free_slots()
        sequence.reused_blocks = 0
        if self.prefixes is None:
            sequence.slot = free[0]
        else:
            prompt = sequence.request.prompt
            # context logits need every prompt position computed
            match = None if sequence.context_rows is not None else self.prefixes.longest(prompt)
            sequence.slot = self.prefixes.choose_slot(free, match)
            kept = match.length if match is not None and sequence.slot in match.sources else 0
            self.prefixes.take(sequence.slot, kept)
            if sequence.slot in self._retained:  # what it kept beyond `kept` is freed; the rest is the new request's
                self._free_kv_blocks += self._retained.pop(sequence.slot)
                self.model.release(sequence.slot, kept)
            if match is not None:
                self.model.reuse(sequence.slot, sequence.slot if kept else min(match.sources), match.length)
                self.prefixes.holds(sequence.slot, prompt, match.length)
                sequence.prefilled = match.length
                sequence.reused_blocks = match.length // self.tokens_per_block
                self._stats.reused_tokens += match.length
        self._active[sequence.slot] = sequence

    def _hold(self, sequence: SequenceState) -> None:
        """A beam search's other slots (with prefix caching the least recently used, whose prefixes are
        forgotten: beams overwrite them)."""
        for _ in range(sequence.request.sampling.beam_width - 1):
            free = self._free_slots()
            slot = free[0] if self.prefixes is None else self.prefixes.choose_slot(free, None)
            if self.prefixes is not None:
                self.prefixes.take(slot, 0)
            sequence.held.append(slot)
            self._held[slot] = sequence
        sequence.beam_slots = [sequence.slot, *sequence.held]

    def _free_slots(self) -> list[int]:
        return [slot for slot in range(self.model.max_batch) if slot not in self._active and slot not in self._held]

    def _release(self, sequence: SequenceState) -> None:
        """Give back the slots and KV-cache blocks of an ending sequence, if it holds them: with prefix caching its
        slot keeps its prompt's whole blocks, retained until a request needs the room."""
        if sequence.slot is None or self._active.get(sequence.slot) is not sequence:
            return
        del self._active[sequence.slot]
        keep = self.prefixes.cached(sequence.slot) if self.prefixes is not None else 0
        self.model.release(sequence.slot, keep)
        retained = keep // self.tokens_per_block  # the prompt's whole blocks
        if retained:
            self._retained[sequence.slot] = retained
        self._free_kv_blocks += sequence.kv_blocks - retained
        self.chooser.release(sequence.slot)
        for slot in sequence.held:
            del self._held[slot]
            self.model.release(slot)

    def _forget_slots(self) -> None:
        """Every slot free, every KV-cache block with it (the model's slots are not released here)."""
        self._active.clear()
        self._held.clear()
        self.chooser.release_all()
        self._free_kv_blocks = self.kv_blocks
        self._retained.clear()
