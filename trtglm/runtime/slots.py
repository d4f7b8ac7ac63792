"""The interface between the in-flight batching executor and a model implementation.

A `SlotModel` owns a preallocated KV cache of `max_batch` slots, each `max_seq_len`
positions long. The executor admits a request by prefilling a free slot with its prompt,
then advances every active slot by one token per decode step; a finished or cancelled
request releases its slot. Requests join and leave the running batch at any step.

Two implementations serve this interface: the portable one over `ShardedModel` (CPU or
GPU, any tensor-parallel size, one process per rank when served) and the fast single-GPU
one (static cache, CUDA graphs). The executor knows nothing else about the model.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class SlotModel(Protocol):
    vocab_size: int  # width of the logits rows returned below
    max_batch: int  # number of slots
    max_seq_len: int  # positions per slot (prompt + generated tokens)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Reset each slot and run its prompt; float32 logits of each prompt's last position, [len(slots), vocab]."""

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Append one token to each slot at its next position; float32 logits, [len(slots), vocab]."""

    def release(self, slot: int) -> None:
        """Forget the slot's sequence; the slot may be prefilled again."""
