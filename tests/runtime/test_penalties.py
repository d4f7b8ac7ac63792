"""Repetition, presence and frequency penalties (trtglm.runtime.sampling.penalised) against their references:
transformers' RepetitionPenaltyLogitsProcessor, and TensorRT-LLM's rule for the additive penalties (its decoder
divides by the temperature first, then lowers each seen id's logit by presence once and by frequency per
occurrence, prompt ids included)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from trtglm.errors import UsageError
from trtglm.request_config import SamplingConfig, check_sampling
from trtglm.runtime.sampling import id_counts, penalised, penalty_scale

VOCAB = 50
PROMPT = [3, 7, 7, 12]
GENERATED = [7, 20, 3]


def penalise(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """One row's logits penalised over PROMPT + GENERATED as the token choice does it."""
    scale = penalty_scale(sampling)
    values = (sampling.repetition_penalty, sampling.presence_penalty * scale, sampling.frequency_penalty * scale)
    return penalised(logits[None], id_counts(PROMPT + GENERATED, VOCAB)[None],
                     *(torch.tensor([value]) for value in values))[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + GENERATED]), logits[None].clone())[0]
    torch.testing.assert_close(penalise(logits, SamplingConfig(repetition_penalty=penalty)), reference)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_presence_and_frequency_follow_tensorrt_llms_order(temperature):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    presence, frequency = 0.8, 0.3
    counts = torch.zeros(VOCAB)
    for token in PROMPT + GENERATED:
        counts[token] += 1
    trtllm = logits / temperature - (counts > 0) * presence - frequency * counts  # TensorRT-LLM's logits
    sampling = SamplingConfig(temperature=temperature, presence_penalty=presence, frequency_penalty=frequency)
    ours = penalise(logits, sampling) / temperature
    torch.testing.assert_close(ours, trtllm)
    assert int(counts[7]) == 3 and ours[7] < logits[7] / temperature - presence - 2 * frequency


def test_rows_of_a_batch_take_their_own_penalties():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    counts = torch.stack([id_counts(ids, VOCAB) for ids in (PROMPT, GENERATED, [])])
    values = torch.tensor([[1.5, 0.0, 0.0], [1.0, 0.5, 0.25], [2.0, 1.0, 1.0]])
    batched = penalised(logits, counts, *values.T)
    for row in range(3):
        alone = penalised(logits[row:row + 1], counts[row:row + 1], *values[row:row + 1].T)
        assert torch.equal(batched[row:row + 1], alone)
    assert torch.equal(batched[2], logits[2])  # nothing seen: nothing penalised


def test_neutral_penalties_leave_the_logits_alone_and_a_bad_repetition_is_refused():
    logits = torch.randn(VOCAB)
    assert not SamplingConfig().penalised and torch.equal(penalise(logits, SamplingConfig()), logits)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="repetition_penalty must be a finite number greater than 0"):
            check_sampling(SamplingConfig(repetition_penalty=bad))


def test_ids_past_the_counted_vocabulary_are_not_counted():
    assert id_counts([1, 1, VOCAB, VOCAB + 5, -1], VOCAB).tolist() == [0, 2] + [0] * (VOCAB - 2)
