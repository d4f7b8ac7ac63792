"""Choosing the next token from logits, by TensorRT-LLM's rules.

A request's logits processors run first: its embedding bias is added, its penalties are
applied (`Penalties`), then banned ids get -inf (a one-token bad word always, a longer one when
the sequence ends with all but its last token, `end_id` and one-token stop words until `min_length`
tokens exist). `Sampler` then chooses: greedy when the temperature is 0 or top_k is 1, otherwise
temperature, then top-k, then top-p, drawn with a generator of its own seeded by the request (the
same seed gives the same tokens). `log_prob` is the log probability of the chosen token under the
distribution it was chosen from (after bias, bans and temperature). Beam search, which does not
sample, is beams.py.
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


def processed(logits: torch.Tensor, bias: torch.Tensor | None, banned: Sequence[int],
              penalties: Penalties | None = None) -> torch.Tensor:
    """float32 `logits` `[vocab]` with the embedding bias added, the penalties applied and the `banned` ids at
    -inf (TensorRT-LLM's order); UsageError when that leaves no token to choose."""
    logits = logits.float()
    if bias is not None:
        bias = bias.to(device=logits.device, dtype=torch.float32)
        logits = logits.clone()
        width = min(bias.numel(), logits.numel())  # past the tokenizer's ids logits are cut off
        logits[:width] += bias[:width]
    if penalties is not None:
        logits = penalties(logits)
    banned = [t for t in banned if t < logits.numel()]
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if not bool(torch.isfinite(logits).any()):
        raise UsageError("every token is excluded (embedding_bias of -inf, or bad_words covering them all)")
    if bool(torch.isnan(logits).any()):
        raise UsageError("the logits hold NaN (an embedding_bias of NaN?)")
    return logits


class Penalties:
    """TensorRT-LLM's repetition, presence and frequency penalties of one request.

    As its decoder does, every id the sequence holds (prompt and generated) counts: a logit of an id
    that occurs is divided by `repetition` when positive and multiplied by it when negative, then
    lowered by `presence` once and by `frequency` for each occurrence. TensorRT-LLM applies them to
    logits already divided by the temperature, and the sampler here divides afterwards, so the
    additive penalties are taken `temperature` times (the same distribution).
    """

    NEUTRAL = {"repetition": 1.0, "presence": 0.0, "frequency": 0.0}

    def __init__(self, repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
                 temperature: float = 0.0):
        if not repetition > 0:
            raise UsageError(f"repetition_penalty must be greater than 0, not {repetition:g}")
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        scale = temperature if temperature > 0 else 1.0  # greedy: the logits are not divided
        self.presence_scaled, self.frequency_scaled = presence * scale, frequency * scale
        self.counts: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return (self.repetition, self.presence, self.frequency) != tuple(self.NEUTRAL.values())

    def start(self, prompt: Sequence[int], vocab: int, device: torch.device) -> None:
        """Count the prompt's ids (before the first token is chosen)."""
        ids = torch.tensor([int(t) for t in prompt if 0 <= int(t) < vocab], dtype=torch.long, device=device)
        self.counts = torch.bincount(ids, minlength=vocab).to(torch.float32)

    def add(self, token: int) -> None:
        if self.counts is not None and 0 <= token < self.counts.numel():
            self.counts[token] += 1

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 `logits` `[vocab]` with the penalties applied."""
        if self.counts is None or not self.active:
            return logits
        width = min(logits.numel(), self.counts.numel())
        counts, head = self.counts[:width], logits[:width]
        seen = counts > 0
        penalized = torch.where(head > 0, head / self.repetition, head * self.repetition)
        penalized = penalized - self.presence_scaled - self.frequency_scaled * counts
        out = logits.clone()
        out[:width] = torch.where(seen, penalized, head)
        return out


def held_until_min_length(end_id: int | None, stop_words: Sequence[Sequence[int]]) -> list[int]:
    """The ids banned while a sequence is shorter than its `min_length`: the end id, as TensorRT-LLM bans it,
    and every one-token stop word (ChatGLM3's `<|user|>` and `<|observation|>` end its replies as `</s>` does;
    vLLM's `min_tokens` holds stop token ids back too). Longer stop words are not held back."""
    return ([end_id] if end_id is not None else []) + [int(word[0]) for word in stop_words if len(word) == 1]
