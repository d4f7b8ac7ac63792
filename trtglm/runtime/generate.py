"""KV cache and token generation (greedy or sampled) on a `ShardedModel`.

Prompts of different lengths share one cache, right-aligned (left padding): each prompt is
prefilled on its own into its row, so padding costs no compute, then all sequences decode
together. Padded slots are masked out and each sequence keeps its own positions, so every
sequence gets the tokens it would get alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from trtglm.errors import UsageError

if TYPE_CHECKING:
    from trtglm.runtime.model import ShardedModel


@dataclass
class KVCache:
    """Preallocated keys/values per rank and layer, `[B, kv_heads_per_rank, max_len, head]`."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    valid: torch.Tensor  # [B, max_len] bool: the slot holds a real token
    length: int = 0  # filled slots

    @classmethod
    def for_model(cls, model: "ShardedModel", batch: int, max_len: int) -> "KVCache":
        cfg = model.config
        shape = (batch, cfg.kv_heads_per_rank, max_len, cfg.head_size)

        def blocks() -> list[list[torch.Tensor]]:
            return [[torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.num_layers)]
                    for _ in model.ranks]

        return cls(blocks(), blocks(), torch.zeros(batch, max_len, dtype=torch.bool, device=model.device))

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def mark_valid(self, steps: int) -> None:
        """The next `steps` slots will hold real tokens."""
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
        """Store this step's k/v; return all keys/values so far for (rank, layer)."""
        end = self.length + k.shape[2]
        self.keys[rank][layer][:, :, self.length:end] = k
        self.values[rank][layer][:, :, self.length:end] = v
        return self.keys[rank][layer][:, :, :end], self.values[rank][layer][:, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps


def full_logits(model: "ShardedModel", tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Teacher-forced float32 logits `[T, vocab]` for one token sequence."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=model.device).reshape(1, -1)
    cache = KVCache.for_model(model, 1, ids.shape[1])
    return model.forward(ids, cache)[0]


def generate(model: "ShardedModel", prompts: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int = 16,
             end_id: int | None = None, stop_ids: Iterable[int] = (), temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None) -> list[int] | list[list[int]]:
    """New token ids for one prompt (a list of ids) or a batch (a list of lists).

    Greedy when temperature is 0 or top_k is 1, otherwise sampled (temperature, then top-k,
    then top-p) with a generator seeded by `seed`. A sequence ends at `end_id` or any of
    `stop_ids` (the stop token is not returned) or after `max_new_tokens`.
    """
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    single = len(prompts) > 0 and isinstance(prompts[0], int)
    batch = [list(prompts)] if single else [list(p) for p in prompts]
    _check_request(model, batch, max_new_tokens, temperature, top_k, top_p)
    stops = set(stop_ids) | ({end_id} if end_id is not None else set())
    sampler = Sampler(temperature, top_k, top_p, seed, model.device)

    logits, positions, cache = _prefill(model, batch, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in batch]
    done = [False] * len(batch)
    for step in range(max_new_tokens):
        chosen = sampler(logits).tolist()
        for i, token in enumerate(chosen):
            if not done[i]:
                done[i] = token in stops
                if not done[i]:
                    outputs[i].append(token)
        if all(done) or step == max_new_tokens - 1:
            break
        positions = positions + 1
        next_ids = torch.tensor(chosen, device=model.device)[:, None]
        logits = model.forward(next_ids, cache, positions)[:, -1]
    return outputs[0] if single else outputs


def _check_request(model: "ShardedModel", batch: list[list[int]], max_new_tokens: int,
                   temperature: float, top_k: int, top_p: float) -> None:
    cfg = model.config
    if not batch or any(not p for p in batch):
        raise UsageError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    bad = [t for p in batch for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    longest = max(map(len, batch)) + max_new_tokens
    if longest > cfg.max_position_embeddings:
        raise UsageError(f"prompt + max_new_tokens = {longest} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UsageError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")


def _prefill(model: "ShardedModel", batch: list[list[int]], max_new_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Run each prompt right-aligned in a shared cache (left padding costs no compute).

    Returns the last logits `[B, vocab]`, the last positions `[B, 1]` and the cache.
    """
    width = max(map(len, batch))
    cache = KVCache.for_model(model, len(batch), width + max_new_tokens)
    last = []
    for i, prompt in enumerate(batch):
        ids = torch.tensor([prompt], device=model.device)
        last.append(model.forward(ids, cache.row(i, width - len(prompt)), last_only=True)[:, -1])
    cache.advance(width)
    positions = torch.tensor([[len(p) - 1] for p in batch], device=model.device)
    return torch.cat(last), positions, cache


class Sampler:
    """Chooses the next token of each row of `[B, vocab]` logits."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int | None, device: torch.device):
        self.greedy = temperature == 0 or top_k == 1
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else random.randrange(2**63))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(dim=-1)
        logits = scale(logits.float(), self.temperature)
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            logits = _top_p(logits, self.top_p)
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, less their maximum first: a tiny temperature (1e-40) gives -inf for all but the
    most likely tokens instead of inf, whose softmax is NaN."""
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities sum to at least `top_p` (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
