"""Choosing the next token from logits, by TensorRT-LLM's rules.

A request's logits processors run first: its embedding bias is added, then banned ids get
-inf (a one-token bad word always, a longer one when the sequence ends with all but its last
token, `end_id` until `min_length` tokens exist). `Sampler` then chooses: greedy when the
temperature is 0 or top_k is 1, otherwise temperature, then top-k, then top-p, drawn with a
generator of its own seeded by the request (the same seed gives the same tokens). `log_prob`
is the log probability of the chosen token under the distribution it was chosen from (after
bias, bans and temperature).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from trtglm.errors import UsageError


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

    def log_prob(self, logits: torch.Tensor, token: int) -> float:
        """log P(token) under the distribution `logits` `[vocab]` (bias and bans applied) gives at this temperature."""
        scaled = logits if self.greedy else scale(logits, self.temperature)
        return float(torch.log_softmax(scaled, dim=-1)[token])


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


class BadWords:
    """The ids that a request's bad words ban after a given history."""

    def __init__(self, words: Sequence[Sequence[int]]):
        self.always = sorted({int(w[-1]) for w in words if len(w) == 1})
        self.after = [([int(t) for t in w[:-1]], int(w[-1])) for w in words if len(w) > 1]

    def banned(self, history: Sequence[int]) -> list[int]:
        return self.always + [last for prefix, last in self.after if list(history[-len(prefix):]) == prefix]


def processed(logits: torch.Tensor, bias: torch.Tensor | None, banned: Sequence[int]) -> torch.Tensor:
    """float32 `logits` `[vocab]` with the embedding bias added and the `banned` ids at -inf; UsageError when that
    leaves no token to choose."""
    logits = logits.float()
    if bias is not None:
        bias = bias.to(device=logits.device, dtype=torch.float32)
        logits = logits.clone()
        width = min(bias.numel(), logits.numel())  # past the tokenizer's ids logits are cut off
        logits[:width] += bias[:width]
    banned = [t for t in banned if t < logits.numel()]
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if not bool(torch.isfinite(logits).any()):
        raise UsageError("every token is excluded (embedding_bias of -inf, or bad_words covering them all)")
    if bool(torch.isnan(logits).any()):
        raise UsageError("the logits hold NaN (an embedding_bias of NaN?)")
    return logits
