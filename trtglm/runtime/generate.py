"""Offline token generation (greedy, sampled or beam search) on a `ShardedModel`, for `trtglm chat`
and `verify`.

Prompts of different lengths share one cache, right-aligned (left padding): each prompt is
prefilled on its own into its row, so padding costs no compute, then all sequences decode
together. Padded slots are masked out and each sequence keeps its own positions, so every
sequence gets the tokens it would get alone. `beam_search` gives each beam a row of its own:
the prompt is prefilled once, and after every step each row takes the cache of the beam it
continues (beams.py has the rules).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Sequence

import torch

from trtglm.errors import UsageError
from trtglm.runtime.cache import KVCache
from trtglm.runtime.model import ShardedModel
from trtglm.runtime.beams import Beam, BeamSearch, ends_with_any
from trtglm.request_config import SamplingConfig, check_sampling
from trtglm.runtime.request import Request
from trtglm.runtime.sampling import TokenChooser, held_until_min_tokens, processed


def full_logits(model: ShardedModel, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Teacher-forced float32 logits `[T, vocab]` for one token sequence."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=model.device).reshape(1, -1)
    cache = KVCache.for_model(model, 1, ids.shape[1])
    return model.forward(ids, cache)[0]


def generate(model: ShardedModel, prompts: Sequence[int] | Sequence[Sequence[int]], max_tokens: int = 16,
             end_id: int | None = None, stop_ids: Iterable[int] = (), sampling: SamplingConfig = SamplingConfig()
             ) -> list[int] | list[list[int]]:
    """New token ids for one prompt (a list of ids) or a batch (a list of lists).

    Tokens are chosen as the served executor chooses them (sampling.TokenChooser): greedy unless `sampling`
    samples, prompt i drawing with seed `sampling.seed + i`. A sequence ends at `end_id` or any of `stop_ids`
    (the stop token is not returned) or after `max_tokens`.
    """
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    single = len(prompts) > 0 and isinstance(prompts[0], int)
    batch = [list(prompts)] if single else [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in batch]
    for chosen in _steps(model, batch, max_tokens, end_id, stop_ids, sampling):
        for output, token in zip(outputs, chosen):
            if token is not None:
                output.append(token)
    return outputs[0] if single else outputs


def stream(model: ShardedModel, prompt: Sequence[int], max_tokens: int = 16, end_id: int | None = None,
           stop_ids: Iterable[int] = (), sampling: SamplingConfig = SamplingConfig()) -> Iterator[int]:
    """`generate`'s new ids for one prompt, each as soon as it is chosen."""
    for (token,) in _steps(model, [list(prompt)], max_tokens, end_id, stop_ids, sampling):
        if token is not None:
            yield token


def _steps(model: ShardedModel, batch: list[list[int]], max_tokens: int, end_id: int | None,
           stop_ids: Iterable[int], sampling: SamplingConfig) -> Iterator[list[int | None]]:
    """Each decode step's new id per sequence (None once the sequence has ended: a stop id is not given)."""
    _check_request(model, batch, max_tokens, sampling)
    stops = set(stop_ids) | ({end_id} if end_id is not None else set())
    chooser = TokenChooser(len(batch), model.config.vocab_size, model.device)
    for row, prompt in enumerate(batch):
        seed = None if sampling.seed is None else sampling.seed + row
        chooser.admit(row, Request(prompt, max_tokens, sampling=dataclasses.replace(sampling, seed=seed)), prompt)
    logits, positions, cache = _prefill(model, batch, max_tokens)
    done = [False] * len(batch)
    for step in range(max_tokens):
        chosen, _, errors = chooser.choose(range(len(batch)), logits)
        if any(errors):
            raise UsageError(next(e for e in errors if e))
        done = [ended or token in stops for ended, token in zip(done, chosen)]
        yield [None if ended else token for ended, token in zip(done, chosen)]
        if all(done) or step == max_tokens - 1:
            return
        positions = positions + 1
        next_ids = torch.tensor(chosen, device=model.device)[:, None]
        logits = model.forward(next_ids, cache, positions)[:, -1]


def beam_search(model: ShardedModel, prompt: Sequence[int], beam_width: int, max_tokens: int = 16,
                end_id: int | None = None, stop_words: Sequence[Sequence[int]] = (), min_length: int = 0,
                length_penalty: float = 1.0, early_stopping: bool | int | str = True) -> list[Beam]:
    """The `beam_width` best continuations of `prompt`, best first, by beam search (beams.py). `end_id` and
    one-token stop words are banned until `min_length` tokens exist; a finished beam's tokens end with its end
    id or stop word."""
    prompt = [int(t) for t in prompt]
    _check_request(model, [prompt], max_tokens, SamplingConfig())
    search = BeamSearch(beam_width, max_tokens, length_penalty, early_stopping,
                        ends_with_any(end_id, stop_words))
    cache = KVCache.for_model(model, beam_width, len(prompt) + max_tokens)
    logits = model.forward(torch.tensor([prompt], device=model.device), cache.row(0, 0), last_only=True)[:, -1]
    cache.advance(len(prompt))
    while True:
        early = held_until_min_tokens(end_id, stop_words) if search.generated < min_length else []
        parents = search.step(torch.log_softmax(processed(logits, None, [early] * len(logits)), dim=-1))
        if search.done:
            return search.result()
        cache.reorder(parents)
        last = torch.tensor([[beam[-1]] for beam in search.running], device=model.device)
        positions = torch.full_like(last, len(prompt) + search.generated - 1)
        logits = model.forward(last, cache, positions)[:, -1]


def _check_request(model: ShardedModel, batch: list[list[int]], max_tokens: int,
                   sampling: SamplingConfig) -> None:
    cfg = model.config
    if not batch or any(not p for p in batch):
        raise UsageError("every prompt needs at least one token")
    if max_tokens < 1:
        raise UsageError(f"max_tokens must be at least 1, not {max_tokens}")
    bad = [t for p in batch for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    longest = max(map(len, batch)) + max_tokens
    if longest > cfg.max_position_embeddings:
        raise UsageError(f"prompt + max_tokens = {longest} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    check_sampling(sampling)


def _prefill(model: ShardedModel, batch: list[list[int]], max_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Run each prompt right-aligned in a shared cache (left padding costs no compute).

    Returns the last logits `[B, vocab]`, the last positions `[B, 1]` and the cache.
    """
    width = max(map(len, batch))
    cache = KVCache.for_model(model, len(batch), width + max_tokens)
    last = []
    for i, prompt in enumerate(batch):
        ids = torch.tensor([prompt], device=model.device)
        last.append(model.forward(ids, cache.row(i, width - len(prompt)), last_only=True)[:, -1])
    cache.advance(width)
    positions = torch.tensor([[len(p) - 1] for p in batch], device=model.device)
    return torch.cat(last), positions, cache
