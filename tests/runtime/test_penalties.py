"""Repetition, presence and frequency penalties (trtglm.runtime.sampling.Penalties) against their references:
transformers' RepetitionPenaltyLogitsProcessor, and TensorRT-LLM's rule for the additive penalties (its decoder
divides by the temperature first, then lowers each seen id's logit by presence once and by frequency per
occurrence, prompt ids included)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from trtglm.errors import UsageError
from trtglm.runtime.sampling import Penalties

VOCAB = 50
PROMPT = [3, 7, 7, 12]
GENERATED = [7, 20, 3]


def penalized(penalties: Penalties, logits: torch.Tensor) -> torch.Tensor:
    penalties.start(PROMPT, VOCAB, torch.device("cpu"))
    for token in GENERATED:
        penalties.add(token)
    return penalties(logits)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + GENERATED]), logits[None].clone())[0]
    torch.testing.assert_close(penalized(Penalties(repetition=penalty), logits), reference)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_presence_and_frequency_follow_tensorrt_llms_order(temperature):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    presence, frequency = 0.8, 0.3
    counts = torch.zeros(VOCAB)
    for token in PROMPT + GENERATED:
        counts[token] += 1
    trtllm = logits / temperature - (counts > 0) * presence - frequency * counts  # TensorRT-LLM's logits
    ours = penalized(Penalties(presence=presence, frequency=frequency, temperature=temperature), logits) / temperature
    torch.testing.assert_close(ours, trtllm)
    assert int(counts[7]) == 3 and ours[7] < logits[7] / temperature - presence - 2 * frequency


def test_neutral_penalties_leave_the_logits_alone_and_a_bad_repetition_is_refused():
    logits = torch.randn(VOCAB)
    neutral = Penalties()
    assert not neutral.active and penalized(neutral, logits) is logits
    with pytest.raises(UsageError, match="repetition_penalty must be greater than 0"):
        Penalties(repetition=0.0)


def test_ids_past_the_counted_vocabulary_are_left_alone():
    logits = torch.randn(VOCAB + 6)  # an engine's padded vocabulary
    out = penalized(Penalties(repetition=2.0), logits)
    torch.testing.assert_close(out[VOCAB:], logits[VOCAB:])
