"""KV caches: where the runtimes keep each sequence's keys and values.

`SlotCache` is what both runtimes' caches are: `num_slots` slots of `max_seq_len` positions,
each holding one sequence left-aligned from position 0, so that a slot's length is also the
position of its next token; a released slot may take another sequence. Two caches implement it:

- `ShardedCache`, the portable runtime's (slot_runtime.py): keys/values[rank][layer]
  `[num_slots, kv_heads_per_rank, max_seq_len, head]` for the ranks held in this process, and
  a mask of the positions that hold real tokens. `ShardedModel.forward` writes through a
  `ForwardCache` view of it: `prefill_view` (one slot, from `start` on) or `decode_view`
  (several slots, one token each, each attending to its own positions only: the mask hides the
  rest, where shorter sequences or a slot's previous occupant left stale entries), or
  `packed_view` (a mixed step: pieces of several slots, decode tokens and prompt chunks, packed
  into one row for the matmuls; it attends itself, each piece over its own slot's positions).
- `PagedCache`, the fast runtime's (fast/model.py): per layer `[blocks, kv_heads_per_rank,
  block_size, head]`, each slot's positions in the blocks its row of a block table names, taken
  as the sequence grows; an extra slot is scratch that padding rows write into; each slot's
  length on the device too, where CUDA graphs read and advance it.

`KVCache` is the offline generator's (generate.py): one batch of sequences right-aligned
(left padding masked out), a `ForwardCache` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from trtglm.errors import UsageError
from trtglm.conventions import TOKENS_PER_BLOCK
from trtglm.runtime.checkpoint import CheckpointConfig
from trtglm.runtime.transfer import upload




@runtime_checkable
class SlotCache(Protocol):
    num_slots: int  # slots
    max_seq_len: int  # positions per slot
    lengths: list[int]  # positions each slot holds

    def reset(self, slot: int) -> None:
        """Forget the slot's sequence."""


class ForwardCache(Protocol):
    """The cache as `ShardedModel.forward` sees it: new tokens go after its first `length` positions."""

    length: int
    valid: torch.Tensor  # [B, positions] bool: the position holds a real token

    def mark_valid(self, steps: int) -> None:
        """The next `steps` positions will hold real tokens."""

    def append(self, rank: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k/v; return the keys/values to attend to for (rank, layer)."""

    def advance(self, steps: int) -> None:
        """The step's positions are written."""


class ShardedModelShape(Protocol):
    """What a cache for a `ShardedModel` is shaped by."""

    config: CheckpointConfig
    ranks: Sequence  # the ranks held in this process, each with its `.rank` number
    dtype: torch.dtype
    device: torch.device


def _zeros(model: ShardedModelShape, batch: int, length: int) -> torch.Tensor:
    cfg = model.config
    return torch.zeros((batch, cfg.kv_heads_per_rank, length, cfg.head_size), dtype=model.dtype, device=model.device)


# --- the offline generator's batch ---------------------------------------------------------------


@dataclass
class KVCache:
    """Preallocated keys/values per rank and layer, `[B, kv_heads_per_rank, max_len, head]`."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    valid: torch.Tensor  # [B, max_len] bool: the slot holds a real token
    length: int = 0  # filled slots

    @classmethod
    def for_model(cls, model: ShardedModelShape, batch: int, max_len: int) -> "KVCache":
        def blocks() -> list[list[torch.Tensor]]:
            return [[_zeros(model, batch, max_len) for _ in range(model.config.num_layers)] for _ in model.ranks]

        return cls(blocks(), blocks(), torch.zeros(batch, max_len, dtype=torch.bool, device=model.device))

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def mark_valid(self, steps: int) -> None:
        end = self.length + steps
        if end > self.max_len:
            raise UsageError(f"sequence of {end} tokens exceeds the KV cache of {self.max_len}")
        self.valid[:, self.length:end] = True

    def row(self, index: int, start: int) -> "KVCache":
        """Sequence `index` from slot `start` on, as an empty cache of its own (views: writes land here)."""
        def view(blocks: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
            return [[t[index:index + 1, :, start:] for t in layers] for layers in blocks]

        return KVCache(view(self.keys), view(self.values), self.valid[index:index + 1, start:])

    def append(self, rank: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.keys[rank][layer][:, :, self.length:end] = k
        self.values[rank][layer][:, :, self.length:end] = v
        return self.keys[rank][layer][:, :, :end], self.values[rank][layer][:, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def reorder(self, rows: Sequence[int]) -> None:
        """Row i takes what row `rows[i]` holds (beam search: each beam continues the one it came from)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.valid.device)
        for block in (*self.keys, *self.values):
            for t in block:
                t.copy_(t[index])
        self.valid.copy_(self.valid[index])


# --- the portable runtime's slots ----------------------------------------------------------------


class ShardedCache:
    """keys/values[rank][layer] `[num_slots, kv_heads_per_rank, max_seq_len, head_size]` for the ranks held here."""

    def __init__(self, model: ShardedModelShape, num_slots: int, max_seq_len: int):
        def blocks() -> dict[int, list[torch.Tensor]]:
            return {r.rank: [_zeros(model, num_slots, max_seq_len) for _ in range(model.config.num_layers)]
                    for r in model.ranks}

        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.keys, self.values = blocks(), blocks()
        self.valid = torch.zeros(num_slots, max_seq_len, dtype=torch.bool, device=model.device)
        self.lengths = [0] * num_slots

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.valid[slot] = False

    def prefill_view(self, slot: int, start: int = 0) -> "_Prefill":
        return _Prefill(self, slot, start)

    def decode_view(self, slots: Sequence[int]) -> "_Decode":
        return _Decode(self, slots)

    def packed_view(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> "_Packed":
        return _Packed(self, slots, starts, lengths)

    def copy(self, slot: int, source: int, length: int) -> None:
        """The slot holds the first `length` positions of `source`."""
        if source != slot:
            for blocks in (self.keys, self.values):
                for layers in blocks.values():
                    for t in layers:
                        t[slot, :, :length] = t[source, :, :length]
        self.reset(slot)
        self.valid[slot, :length] = True
        self.lengths[slot] = length


class _Prefill:
    """One slot as `ShardedModel.forward` sees it while a prompt (or a chunk of one, after the `start`
    positions already cached) runs into it (views: writes land)."""

    def __init__(self, cache: ShardedCache, slot: int, start: int = 0):
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
    """Several slots as `ShardedModel.forward` sees them for one new token each.

    forward attends over positions `0 … length` where `length` is the longest slot's; `valid`
    (gathered per step) limits each slot to its own positions.
    """

    def __init__(self, cache: ShardedCache, slots: Sequence[int]):
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


class _Packed:
    """Pieces of several slots packed into one row for `ShardedModel.forward` (`positions` `[1, tokens]`, logits of
    the rows `last`): piece i's tokens go at positions `starts[i]…` of `slots[i]`. `attend` replaces attention over
    the row: one-token pieces (decode tokens) attend together, each over its own slot's positions up to its own;
    longer pieces (prompt chunks) each over their slot's, causally. No token sees another slot's positions."""

    def __init__(self, cache: ShardedCache, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int]):
        device = cache.valid.device
        self.cache, self.slots, self.starts = cache, list(slots), list(starts)
        self.ends = [start + n for start, n in zip(starts, lengths)]
        firsts = [sum(lengths[:i]) for i in range(len(lengths))]
        self.token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], device=device)
        self.positions = torch.cat([torch.arange(a, b, device=device) for a, b in zip(starts, self.ends)])
        self.last = torch.tensor([first + n - 1 for first, n in zip(firsts, lengths)], device=device)
        singles = [i for i, n in enumerate(lengths) if n == 1]
        self.single_rows = torch.tensor([firsts[i] for i in singles], dtype=torch.long, device=device)
        self.single_span = max((self.ends[i] for i in singles), default=0)
        self.chunks = [(slots[i], starts[i], firsts[i], n) for i, n in enumerate(lengths) if n > 1]
        self.length = 0  # forward's own positions and mask are not used: the view attends itself
        self.valid = cache.valid[:1, :0]

    def mark_valid(self, steps: int) -> None:
        for slot, start, end in zip(self.slots, self.starts, self.ends):
            self.cache.valid[slot, start:end] = True

    def append(self, rank: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.keys[rank][layer], self.cache.values[rank][layer]
        keys[self.token_slots, :, self.positions] = k[0].transpose(0, 1)
        values[self.token_slots, :, self.positions] = v[0].transpose(0, 1)
        return keys, values

    def attend(self, rank: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the row's queries `q` `[1, heads, tokens, head]` after storing its keys/values."""
        keys, values = self.append(rank, layer, k, v)
        out = torch.empty_like(q)
        if len(self.single_rows):
            rows, span = self.single_rows, self.single_span
            slots, positions = self.token_slots[rows], self.positions[rows]
            visible = torch.arange(span, device=q.device)[None] <= positions[:, None]
            attended = F.scaled_dot_product_attention(q[0, :, rows].transpose(0, 1)[:, :, None],
                                                      keys[slots, :, :span], values[slots, :, :span],
                                                      attn_mask=visible[:, None, None], enable_gqa=True)
            out[0, :, rows] = attended[:, :, 0].transpose(0, 1)
        for slot, start, first, n in self.chunks:
            causal = torch.arange(start + n, device=q.device)[None] <= \
                torch.arange(start, start + n, device=q.device)[:, None]
            out[:, :, first:first + n] = F.scaled_dot_product_attention(
                q[:, :, first:first + n], keys[slot:slot + 1, :, :start + n], values[slot:slot + 1, :, :start + n],
                attn_mask=causal, enable_gqa=True)
        return out

    def advance(self, steps: int) -> None:
        for slot, end in zip(self.slots, self.ends):
            self.cache.lengths[slot] = end


# --- the fast runtime's slots --------------------------------------------------------------------


class PagedCache:
    """keys/values[layer] `[blocks, kv_heads_per_rank, block_size, head_size]` (this rank's KV heads; in `dtype`, the
    compute dtype or float8_e4m3fn, whose values stand for themselves times their layer's `scales`): position p of a
    slot lies in block `table[slot, p // block_size]`. A slot takes blocks as its sequence grows (`hold`, before a pass
    writes them) and gives them back when released, so memory goes to the positions sequences hold, not to
    num_slots × max_seq_len: `kv_tokens` positions in all (None: that product), which the executor shares out as
    TensorRT-LLM's `guaranteed_no_evict` scheduler does (each request's whole length reserved at admission).

    Block 0 is a sink: every table entry no sequence holds names it, so padding rows written past a sequence's blocks
    land there and never in another sequence's. Slot `scratch` (= num_slots, where padding rows and `score` write)
    holds max_seq_len positions of its own. `lengths` on the host, `device_lengths` (int32) where the CUDA graphs read
    and advance them; the table's changes are uploaded as they are made (stream-ordered, no host wait)."""

    SINK = 0

    def __init__(self, cfg: CheckpointConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = TOKENS_PER_BLOCK, kv_tokens: int | None = None,
                 scales: Sequence[float] | None = None):
        if block_size < 1 or (kv_tokens is not None and kv_tokens < max_seq_len):
            raise UsageError(f"a paged KV cache needs block_size >= 1 and room for one whole sequence "
                             f"({max_seq_len} positions), not {block_size} and {kv_tokens}")
        self.num_slots, self.max_seq_len, self.scratch, self.block_size = num_slots, max_seq_len, num_slots, block_size
        self.blocks_per_slot = -(-max_seq_len // block_size)
        self.kv_tokens = kv_tokens or num_slots * max_seq_len
        sequence_blocks = -(-self.kv_tokens // block_size)
        first = 1 + self.blocks_per_slot  # after the sink and the scratch slot's blocks
        shape = (first + sequence_blocks, cfg.kv_heads_per_rank, block_size, cfg.head_size)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.scales = list(scales or [1.0] * cfg.num_layers)  # an FP8 cache's, per layer: stored value × scale
        self.table = torch.full((num_slots + 1, self.blocks_per_slot), self.SINK, dtype=torch.int32, device=device)
        self.held: list[list[int]] = [[] for _ in range(num_slots + 1)]  # slot -> its blocks, first to last
        self.held[self.scratch] = list(range(1, first))
        self.table[self.scratch] = torch.arange(1, first, dtype=torch.int32, device=device)
        self._free = list(range(first + sequence_blocks - 1, first - 1, -1))  # popped lowest first
        self.lengths = [0] * (num_slots + 1)
        self.device_lengths = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def hold(self, slot: int, positions: int) -> None:
        """The slot's first `positions` positions have blocks (taken from the free ones as needed)."""
        held = self.held[slot]
        needed = -(-positions // self.block_size) - len(held)
        if needed <= 0:
            return
        if needed > len(self._free):
            raise UsageError(f"the KV cache is full: slot {slot} needs {needed} more blocks of {self.block_size} "
                             f"positions, {len(self._free)} are free")
        taken = [self._free.pop() for _ in range(needed)]
        self.table[slot, len(held):len(held) + needed] = upload(taken, self.table.device, torch.int32)
        held += taken

    def reset(self, slot: int, keep: int = 0) -> None:
        """Forget the slot's sequence; the blocks of its first `keep` positions stay (a prefix to reuse), the others
        are freed."""
        self.lengths[slot] = 0
        kept = -(-keep // self.block_size)
        freed = self.held[slot][kept:]
        if freed:
            del self.held[slot][kept:]
            self._free += reversed(freed)
            self.table[slot, kept:] = self.SINK

    def set_lengths(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Slots just prefilled hold `lengths` positions (on the host and on the device)."""
        for slot, length in zip(slots, lengths, strict=True):
            self.lengths[slot] = length
        device = self.device_lengths.device
        self.device_lengths[upload(list(slots), device)] = upload(list(lengths), device, torch.int32)

    def copy(self, slot: int, source: int, length: int) -> None:
        """The slot holds the first `length` positions of `source` (its blocks' copies: the two go their own ways)."""
        count = -(-length // self.block_size)
        if count > len(self.held[source]):
            raise UsageError(f"slot {source} holds {len(self.held[source]) * self.block_size} cached positions, not "
                             f"{length}")
        if source != slot:
            self.reset(slot)
            self.hold(slot, length)
            device = self.table.device
            targets, sources = upload(self.held[slot][:count], device), upload(self.held[source][:count], device)
            for t in (*self.keys, *self.values):
                raw = t.view(torch.uint8) if t.element_size() == 1 else t  # FP8 blocks copied as bytes
                raw[targets] = raw[sources]
        self.set_lengths([slot], [length])

    def advance(self, slots: Sequence[int]) -> None:
        """One more position in each of `slots` (on the host: the decode step advanced the device's)."""
        for slot in slots:
            self.lengths[slot] += 1
