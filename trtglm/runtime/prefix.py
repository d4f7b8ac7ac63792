"""Prefix caching: which slots hold which prompt prefixes, block by block.

A prompt is cut into blocks of `tokens_per_block` tokens (TensorRT-LLM's KV-cache block size);
only whole blocks are shared, as TensorRT-LLM's `enable_kv_cache_reuse` shares them. The
blocks form a tree (a block's key is its tokens under its parent block), and each block
records the slots whose cache holds it at its positions. A slot's positions stay as they were
written until a new sequence is prefilled into it, also after its request ends, so a free
slot keeps serving its prefix until it is taken. Slots taken for new requests are chosen
least recently used first: under memory pressure, the prefixes used longest ago go first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Block:
    parent: "_Block | None"
    tokens: tuple[int, ...]
    slots: set[int] = field(default_factory=set)
    children: dict[tuple[int, ...], "_Block"] = field(default_factory=dict)


@dataclass(frozen=True)
class Match:
    sources: frozenset[int]  # the slots whose caches hold the prefix
    length: int  # tokens of the prefix (whole blocks)


class PrefixIndex:
    """The prompt blocks each of `slots` slots holds, and the order the slots were last used in."""

    def __init__(self, tokens_per_block: int, slots: int):
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, not {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self._root = _Block(None, ())
        self._held: list[list[_Block]] = [[] for _ in range(slots)]  # slot -> its blocks, first to last
        self._clock = itertools.count(1)
        self._used = [0] * slots  # slot -> when it last served a request

    def longest(self, prompt: Sequence[int]) -> Match | None:
        """The longest cached prefix of `prompt` that leaves at least one of its tokens to compute."""
        block, found, size = self._root, None, self.tokens_per_block
        for depth in range((len(prompt) - 1) // size):
            block = block.children.get(tuple(prompt[depth * size:(depth + 1) * size]))
            if block is None or not block.slots:
                break
            found = Match(frozenset(block.slots), (depth + 1) * size)
        return found

    def choose_slot(self, free: Iterable[int], match: Match | None) -> int:
        """Of the `free` slots, the one that holds the match itself (no copy), else the least recently used."""
        free = list(free)
        holding = [slot for slot in free if match is not None and slot in match.sources]
        return min(holding or free, key=lambda slot: self._used[slot])

    def take(self, slot: int, kept: int) -> None:
        """A new request starts in `slot`, keeping its first `kept` tokens' blocks (the rest is overwritten)."""
        self._used[slot] = next(self._clock)
        self._forget(slot, kept // self.tokens_per_block)

    def cached(self, slot: int) -> int:
        """Tokens of whole prompt blocks `slot` holds."""
        return len(self._held[slot]) * self.tokens_per_block

    def forget(self, slot: int) -> None:
        """`slot` holds nothing any more (its cache was given to others)."""
        self._forget(slot, 0)

    def holds(self, slot: int, prompt: Sequence[int], cached: int) -> None:
        """`slot` holds the first `cached` tokens of `prompt` (its whole blocks are added)."""
        size, held = self.tokens_per_block, self._held[slot]
        block = held[-1] if held else self._root
        for depth in range(len(held), cached // size):
            key = tuple(prompt[depth * size:(depth + 1) * size])
            block = block.children.setdefault(key, _Block(block, key))
            block.slots.add(slot)
            held.append(block)

    def clear(self) -> None:
        """Forget every block (the caches' contents can no longer be trusted)."""
        for slot in range(len(self._held)):
            self._forget(slot, 0)

    def _forget(self, slot: int, keep: int) -> None:
        held = self._held[slot]
        for block in reversed(held[keep:]):
            block.slots.discard(slot)
            if not block.slots and not block.children and block.parent is not None:
                del block.parent.children[block.tokens]
        del held[keep:]
