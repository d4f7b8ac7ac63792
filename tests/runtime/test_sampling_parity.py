"""Token choice through the in-flight executor against transformers' `generate()` on the fixture model: greedy,
temperature, top-k, top-p (seeded: the executor's seed and `torch.manual_seed` draw the same tokens), min_length
(transformers' min_new_tokens), repetition penalty (its processor), and presence/frequency penalties (TensorRT-LLM's
rule, which transformers lacks, as a processor that divides by the temperature first: TensorRT-LLM applies them to
logits already divided by it, and transformers runs custom processors before its own temperature, left at 1)."""

from __future__ import annotations

import pytest
import torch
from support.references import four_prompts, glm_reference, tp1_model  # noqa: F401 (fixtures)
from support.tokenizer import tok  # noqa: F401 (fixture)

from trtglm.runtime.executor import Executor, Request
from trtglm.runtime.slot_runtime import ShardedSlotModel

NEW = 24


class TensorRTLLMPenalties:
    """TensorRT-LLM's temperature, then its presence and frequency penalties, as a transformers processor: the
    logits are divided by `temperature` (1: greedy), then each id the sequence holds (prompt included) is lowered
    by `presence` once and by `frequency` per occurrence."""

    def __init__(self, presence: float, frequency: float, temperature: float = 1.0):
        self.presence, self.frequency, self.temperature = presence, frequency, temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores / self.temperature - self.presence * (counts > 0) - self.frequency * counts


def executor_tokens(model, prompts, **settings) -> list[list[int]]:
    """Every prompt's tokens, all requests in flight together (seed i for prompt i when sampling)."""
    executor, outputs = Executor(ShardedSlotModel(model, max_batch=len(prompts), max_seq_len=256)), []
    sampled = settings.get("temperature", 0) > 0
    for i, prompt in enumerate(prompts):
        outputs.append([])
        executor.submit(Request(prompt, NEW, seed=i if sampled else None, **settings), outputs[-1].append)
    while executor.has_work():
        executor.step()
    return [[t for output in out for t in output.tokens] for out in outputs]


def transformers_tokens(reference, prompt, seed, end_id=None, processors=(), **settings) -> list[int]:
    from transformers import LogitsProcessorList

    torch.manual_seed(seed)
    sampled = settings.get("temperature", 0) > 0
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW, do_sample=sampled, top_k=settings.pop("top_k", 0),
                                 logits_processor=LogitsProcessorList(processors), eos_token_id=end_id,
                                 pad_token_id=0, **settings)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(end_id)] if end_id in new else new


SETTINGS = {
    "greedy": {},
    "temperature": {"temperature": 1.5},
    "top_k": {"temperature": 2.0, "top_k": 20},
    "top_p": {"temperature": 3.0, "top_p": 0.7},
    "top_k and top_p": {"temperature": 2.5, "top_k": 30, "top_p": 0.9},
    "repetition, sampled": {"temperature": 1.5, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_executor_chooses_transformers_tokens(tp1_model, glm_reference, four_prompts, name):
    settings = SETTINGS[name]
    ours = executor_tokens(tp1_model, four_prompts, **settings)
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, ours)):
        assert tokens == transformers_tokens(glm_reference, prompt, seed, **settings), (name, seed)
    if settings:
        assert ours != executor_tokens(tp1_model, four_prompts)  # the setting changed the replies


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_presence_and_frequency_penalties_are_tensorrt_llms(tp1_model, glm_reference, four_prompts, temperature):
    ours = executor_tokens(tp1_model, four_prompts, temperature=temperature, presence_penalty=0.8,
                           frequency_penalty=0.5)
    penalties = TensorRTLLMPenalties(0.8, 0.5, temperature or 1.0)
    settings = {"temperature": 1.0} if temperature else {}  # sampled; the processor divides by the temperature
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, ours)):
        assert tokens == transformers_tokens(glm_reference, prompt, seed, processors=[penalties], **settings)
    assert ours != executor_tokens(tp1_model, four_prompts, temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_min_length_is_transformers_min_new_tokens(tp1_model, glm_reference, four_prompts, tok, temperature):
    """With the end id the replies reach early (the fixture's <|user|>), min_length holds it back as
    min_new_tokens does."""
    end_id, settings = tok.special_ids["<|user|>"], {"temperature": temperature} if temperature else {}
    free = executor_tokens(tp1_model, four_prompts, end_id=end_id, **settings)
    held = executor_tokens(tp1_model, four_prompts, end_id=end_id, min_length=15, **settings)
    assert any(len(tokens) < 15 for tokens in free) and all(len(tokens) >= 15 for tokens in held)
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, held)):
        assert tokens == transformers_tokens(glm_reference, prompt, seed, end_id=end_id, min_new_tokens=15, **settings)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_min_length_holds_back_one_token_stop_words(tp1_model, glm_reference, four_prompts, tok, temperature):
    """ChatGLM3's <|user|> as a stop word (as preprocessing sends it) is held back until min_length as the end
    id is: transformers' min_new_tokens over both as end ids. The stop word, when it comes, is returned."""
    user, end_id = tok.special_ids["<|user|>"], tok.eos_id
    settings = {"temperature": temperature} if temperature else {}
    free = executor_tokens(tp1_model, four_prompts, end_id=end_id, stop_words=[[user]], **settings)
    held = executor_tokens(tp1_model, four_prompts, end_id=end_id, stop_words=[[user]], min_length=15, **settings)
    assert any(len(tokens) < 15 for tokens in free) and all(len(tokens) >= 15 for tokens in held)
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, held)):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = glm_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                                         max_new_tokens=NEW, do_sample=temperature > 0, top_k=0,
                                         eos_token_id=[end_id, user], pad_token_id=0, min_new_tokens=15, **settings)
        new = out[0, len(prompt):].tolist()
        assert tokens == (new[:new.index(end_id)] if end_id in new else new), seed
