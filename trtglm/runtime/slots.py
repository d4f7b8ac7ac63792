"""The interface between the in-flight batching executor and a model implementation.

A `SlotModel` owns a KV cache of `num_slots` slots, each up to `max_seq_len` positions long,
`kv_tokens` positions in all (a paged cache holds fewer than num_slots × max_seq_len: the
executor admits a request only while the cache has room for its whole length). The executor admits a request by prefilling a free slot with its prompt,
then advances every active slot by one token per decode step; a finished or cancelled
request releases its slot. Requests join and leave the running batch at any step.

A prompt may be prefilled in chunks over several calls: a chunk that starts at position
`start > 0` continues its slot, attending to the `start` positions already cached, so the
slot ends up as one prefill of the whole prompt would leave it, with the same logits.

`step` is the in-flight batching executor's mixed pass: the next token of every decoding slot
and the prompt chunks of others go through one forward pass together (a decode is a chunk of
one token after the slot's cached positions). `reuse` starts a slot with the first positions
of another slot's cache (prefix caching: a shared prompt prefix is copied, not computed again).

Two implementations serve this interface: the portable one over `ShardedModel` (CPU or
GPU, any tensor-parallel size, one process per rank when served) and the fast GPU one (paged
cache, CUDA graphs; one GPU, or one GPU per rank). The executor knows nothing else about the model.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from trtglm.errors import UsageError


class SlotModel(Protocol):
    vocab_size: int  # width of the logits rows returned below
    num_slots: int  # number of slots
    max_seq_len: int  # positions per slot (prompt + generated tokens)
    kv_tokens: int  # positions of all slots together (at most num_slots × max_seq_len)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                starts: Sequence[int] | None = None) -> torch.Tensor:
        """Run each prompt, or chunk of one, into its slot; float32 logits of each one's last position,
        [len(slots), vocab].

        Prompt i holds positions `starts[i] … starts[i] + len(prompts[i]) - 1` of slot i (`starts`
        None: all 0). Start 0 resets the slot first; a start > 0 continues a slot that holds exactly
        `start` positions (UsageError otherwise).
        """

    def decode(self, slots: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one token to each slot at its next position; float32 logits, [len(slots), vocab]. `tokens` may be
        a tensor on the model's device (the tokens the last step chose, never brought to the host)."""

    def step(self, slots: Sequence[int], pieces: Sequence[Sequence[int] | None], starts: Sequence[int],
             decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass of every piece into its slot, as `prefill(slots, pieces, starts)` leaves the cache, with
        its logits: float32, each piece's last position, [len(slots), vocab]. The first pieces may be None: decode
        tokens whose ids are `decode_ids`, in order (a tensor on the model's device)."""

    def prefill_all(self, slot: int, chunk: Sequence[int], start: int = 0) -> torch.Tensor:
        """Run one prompt chunk into its slot, as `prefill([slot], [chunk], [start])` does; float32 logits of every
        one of its positions, [len(chunk), vocab] (a request that asks for its context logits)."""

    def reuse(self, slot: int, source: int, length: int) -> None:
        """The slot holds the first `length` positions of `source`'s cache (copied unless `source` is `slot`); a
        released source keeps what `release` kept until it is prefilled again."""

    def release(self, slot: int, keep: int = 0) -> None:
        """Forget the slot's sequence; the slot may be prefilled again. Its first `keep` positions stay cached for a
        later `reuse` (a paged cache frees the others' memory)."""

    def copy(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Each target slot takes a copy of its source slot's sequence (beam search: a beam that continues
        another beam). No target is also a source."""


def filled_pieces(pieces: Sequence[Sequence[int] | None], decode_ids: torch.Tensor | None) -> list[list[int]]:
    """`pieces` with each None replaced by the next of `decode_ids` (brought to the host: this waits for the
    device)."""
    ids = iter(decode_ids.tolist() if decode_ids is not None else [])
    try:
        filled = [[next(ids)] if piece is None else [int(t) for t in piece] for piece in pieces]
    except StopIteration:
        raise UsageError("a step has more decode pieces than decode ids") from None
    if next(ids, None) is not None:
        raise UsageError("a step has more decode ids than decode pieces")
    return filled


def prefill_starts(starts: Sequence[int] | None, count: int) -> list[int]:
    """`starts` of a prefill of `count` prompts as a list (None: every prompt starts its slot afresh)."""
    if starts is None:
        return [0] * count
    starts = [int(s) for s in starts]
    if len(starts) != count:
        raise UsageError(f"{count} prompts but {len(starts)} starts")
    if any(s < 0 for s in starts):
        raise UsageError(f"a prefill cannot start at a negative position ({min(starts)})")
    return starts


def check_copy(sources: Sequence[int], targets: Sequence[int], num_slots: int) -> None:
    """UsageError unless `targets` are distinct slots apart from `sources`, one for each."""
    if len(sources) != len(targets) or len(set(targets)) != len(targets) or set(sources) & set(targets):
        raise UsageError(f"a copy needs one distinct target slot, not also a source, per source: {list(sources)} -> "
                         f"{list(targets)}")
    bad = [s for s in (*sources, *targets) if not 0 <= s < num_slots]
    if bad:
        raise UsageError(f"slot {bad[0]} does not exist (0..{num_slots - 1})")


def check_start(slot: int, start: int, cached: int) -> None:
    """UsageError unless a chunk starting at `start` may continue a slot that holds `cached` positions."""
    if start and start != cached:
        raise UsageError(f"slot {slot} holds {cached} positions: a prefill continuing it starts at {cached}, "
                         f"not {start}")


def check_reuse(slot: int, source: int, length: int, max_seq_len: int) -> None:
    """UsageError unless `slot` may start with `length` positions of `source`. A released slot's positions stay
    as they were until it is prefilled again: the caller knows what they hold."""
    if not 0 < length < max_seq_len:
        raise UsageError(f"slot {slot} cannot reuse {length} positions of slot {source} (1 to {max_seq_len - 1})")
