"""The portable `SlotModel`: slots of a preallocated KV cache over a `ShardedModel`.

Works for any tensor-parallel size, with every rank in this process (`LocalGroup`) or one
rank per process (a torch.distributed group), on CPU or GPU. Each slot holds one sequence
left-aligned from position 0, so a slot's length is also the position of its next token.

A prefill runs each prompt on its own, straight into its slot (no padding computed); a chunk
that continues a slot appends after its cached positions and attends to them. A decode
step runs the given slots together: each writes its new key/value at its own length, and
attends to its own first `length + 1` positions only (the mask hides the rest of the cache,
where shorter sequences or a slot's previous occupant left stale entries).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtglm.errors import UsageError
from trtglm.runtime.model import ShardedModel
from trtglm.runtime.slots import check_start, prefill_starts


class SlotCache:
    """keys/values[rank][layer] `[max_batch, kv_heads_per_rank, max_seq_len, head_size]` for the ranks held here."""

    def __init__(self, model: ShardedModel, max_batch: int, max_seq_len: int):
        cfg = model.config
        shape = (max_batch, cfg.kv_heads_per_rank, max_seq_len, cfg.head_size)

        def blocks() -> dict[int, list[torch.Tensor]]:
            return {r.rank: [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.num_layers)]
                    for r in model.ranks}

        self.keys, self.values = blocks(), blocks()
        self.valid = torch.zeros(max_batch, max_seq_len, dtype=torch.bool, device=model.device)
        self.lengths = [0] * max_batch

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.valid[slot] = False


class _Prefill:
    """One slot's cache as `ShardedModel.forward` sees it while a prompt (or a chunk of one, after the
    `start` positions already cached) runs into the slot (views: writes land)."""

    def __init__(self, cache: SlotCache, slot: int, start: int = 0):
        self.cache, self.slot = cache, slot
        self.length = start
        self.valid = cache.valid[slot:slot + 1]

    def mark_valid(self, steps: int) -> None:
        self.valid[:, self.length:self.length + steps] = True

    def append(self, rank: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end, s = self.length, self.length + k.shape[2], self.slot
        keys, values = self.cache.keys[rank][layer], self.cache.values[rank][layer]
        keys[s:s + 1, :, start:end] = k
        values[s:s + 1, :, start:end] = v
        return keys[s:s + 1, :, :end], values[s:s + 1, :, :end]

    def advance(self, steps: int) -> None:
        self.cache.lengths[self.slot] = self.length + steps


class _Decode:
    """Several slots' caches as `ShardedModel.forward` sees them for one new token each.

    forward attends over positions `0 … length` where `length` is the longest slot's; `valid`
    (gathered per step) limits each slot to its own positions.
    """

    def __init__(self, cache: SlotCache, slots: Sequence[int]):
        self.cache = cache
        device = cache.valid.device
        self.rows = torch.tensor(list(slots), dtype=torch.long, device=device)
        self.positions = torch.tensor([cache.lengths[s] for s in slots], dtype=torch.long, device=device)
        self.slots = list(slots)
        self.length = max(cache.lengths[s] for s in slots)
        self.valid = cache.valid[self.rows]

    def mark_valid(self, steps: int) -> None:
        self.cache.valid[self.rows, self.positions] = True
        self.valid = self.cache.valid[self.rows]

    def append(self, rank: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.keys[rank][layer], self.cache.values[rank][layer]
        keys[self.rows, :, self.positions] = k[:, :, 0]
        values[self.rows, :, self.positions] = v[:, :, 0]
        end = self.length + 1
        return keys[self.rows, :, :end], values[self.rows, :, :end]

    def advance(self, steps: int) -> None:
        for slot in self.slots:
            self.cache.lengths[slot] += steps


class ShardedSlotModel:
    """`SlotModel` (trtglm.runtime.slots) over a `ShardedModel`."""

    def __init__(self, model: ShardedModel, max_batch: int, max_seq_len: int):
        if max_batch < 1 or max_seq_len < 2:
            raise UsageError(f"need max_batch >= 1 and max_seq_len >= 2, not {max_batch} and {max_seq_len}")
        if max_seq_len > model.config.max_position_embeddings:
            raise UsageError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.cache = SlotCache(model, max_batch, max_seq_len)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                starts: Sequence[int] | None = None) -> torch.Tensor:
        starts = prefill_starts(starts, len(prompts))
        if len(slots) != len(prompts):
            raise UsageError(f"{len(slots)} slots but {len(prompts)} prompts")
        for slot, prompt, start in zip(slots, prompts, starts):
            self._check_prefill(slot, len(prompt), start)
        rows = []
        for slot, prompt, start in zip(slots, prompts, starts):
            if start == 0:
                self.cache.reset(slot)
            ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.model.device)
            rows.append(self.model.forward(ids, _Prefill(self.cache, slot, start), last_only=True)[:, -1])
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        if len(slots) != len(tokens) or not slots:
            raise UsageError("decode needs one token for each of at least one slot")
        for slot in slots:
            self._check_slot(slot)
            if not 0 < self.cache.lengths[slot] < self.max_seq_len:
                raise UsageError(f"slot {slot} holds {self.cache.lengths[slot]} tokens: nothing to continue, or full "
                                 f"({self.max_seq_len})")
        view = _Decode(self.cache, slots)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.model.device)[:, None]
        return self.model.forward(ids, view, view.positions[:, None])[:, -1]

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self.cache.reset(slot)

    def _check_prefill(self, slot: int, length: int, start: int) -> None:
        self._check_slot(slot)
        check_start(slot, start, self.cache.lengths[slot])
        if not 0 < length <= self.max_seq_len - start:
            raise UsageError(f"a prompt needs 1 to {self.max_seq_len} tokens, not {length}" if not start else
                             f"a chunk after {start} cached positions needs 1 to {self.max_seq_len - start} tokens, "
                             f"not {length}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise UsageError(f"slot {slot} does not exist (0..{self.max_batch - 1})")
