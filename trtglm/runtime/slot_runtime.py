"""The portable `SlotModel`: the slots of a `ShardedCache` (cache.py) over a `ShardedModel`.

Works for any tensor-parallel size, with every rank in this process (`LocalGroup`) or one
rank per process (a torch.distributed group), on CPU or GPU.

A prefill runs each prompt on its own, straight into its slot (no padding computed); a chunk
that continues a slot appends after its cached positions and attends to them. A decode
step runs the given slots together: each writes its new key/value at its own length, and
attends to its own first `length + 1` positions only. A mixed step (`step`) packs decode tokens
and prompt chunks of several slots into one row of one forward pass: the matmuls take every
token at once; the decode tokens attend together and each chunk on its own, each over its own
slot's positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtglm.errors import UsageError
from trtglm.runtime.cache import ShardedCache
from trtglm.runtime.model import ShardedModel
from trtglm.runtime.slots import check_copy, check_reuse, check_start, filled_pieces, prefill_starts


class ShardedSlotModel:
    """`SlotModel` (trtglm.runtime.slots) over a `ShardedModel`."""

    def __init__(self, model: ShardedModel, num_slots: int, max_seq_len: int):
        if num_slots < 1 or max_seq_len < 2:
            raise UsageError(f"need num_slots >= 1 and max_seq_len >= 2, not {num_slots} and {max_seq_len}")
        if max_seq_len > model.config.max_position_embeddings:
            raise UsageError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.cache = ShardedCache(model, num_slots, max_seq_len)

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
            rows.append(self.model.forward(ids, self.cache.prefill_view(slot, start), last_only=True)[:, -1])
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def decode(self, slots: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if len(slots) != len(tokens) or not slots:
            raise UsageError("decode needs one token for each of at least one slot")
        for slot in slots:
            self._check_slot(slot)
            if not 0 < self.cache.lengths[slot] < self.max_seq_len:
                raise UsageError(f"slot {slot} holds {self.cache.lengths[slot]} tokens: nothing to continue, or full "
                                 f"({self.max_seq_len})")
        view = self.cache.decode_view(slots)
        ids = torch.as_tensor(tokens if isinstance(tokens, torch.Tensor) else list(tokens), dtype=torch.long,
                              device=self.model.device)[:, None]
        return self.model.forward(ids, view, view.positions[:, None])[:, -1]

    def step(self, slots: Sequence[int], pieces: Sequence[Sequence[int] | None], starts: Sequence[int],
             decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        pieces = filled_pieces(pieces, decode_ids)
        starts = prefill_starts(starts, len(pieces))
        if len(slots) != len(pieces) or not slots or len(set(slots)) != len(slots):
            raise UsageError("a step needs one piece for each of at least one slot, each slot once")
        for slot, piece, start in zip(slots, pieces, starts):
            self._check_prefill(slot, len(piece), start)
        for slot, start in zip(slots, starts):
            if start == 0:
                self.cache.reset(slot)
        view = self.cache.packed_view(slots, starts, [len(p) for p in pieces])
        ids = torch.tensor([[t for piece in pieces for t in piece]], dtype=torch.long, device=self.model.device)
        return self.model.forward(ids, view, view.positions[None], rows=view.last)[0]

    def prefill_all(self, slot: int, chunk: Sequence[int], start: int = 0) -> torch.Tensor:
        self._check_prefill(slot, len(chunk), start)
        if start == 0:
            self.cache.reset(slot)
        ids = torch.tensor([list(chunk)], dtype=torch.long, device=self.model.device)
        return self.model.forward(ids, self.cache.prefill_view(slot, start))[0]

    def reuse(self, slot: int, source: int, length: int) -> None:
        self._check_slot(slot)
        self._check_slot(source)
        check_reuse(slot, source, length, self.max_seq_len)
        self.cache.copy(slot, source, length)

    @property
    def kv_tokens(self) -> int:
        return self.num_slots * self.max_seq_len  # a static cache: every slot's every position

    def release(self, slot: int, keep: int = 0) -> None:
        """Forget the slot's sequence (its positions stay as they are, `keep` or not, until it is prefilled again)."""
        self._check_slot(slot)
        self.cache.reset(slot)

    def copy(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        check_copy(sources, targets, self.num_slots)
        for source, target in zip(sources, targets):
            self.cache.copy(target, source, self.cache.lengths[source])

    def _check_prefill(self, slot: int, length: int, start: int) -> None:
        self._check_slot(slot)
        check_start(slot, start, self.cache.lengths[slot])
        if not 0 < length <= self.max_seq_len - start:
            raise UsageError(f"a prompt needs 1 to {self.max_seq_len} tokens, not {length}" if not start else
                             f"a chunk after {start} cached positions needs 1 to {self.max_seq_len - start} tokens, "
                             f"not {length}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise UsageError(f"slot {slot} does not exist (0..{self.num_slots - 1})")
