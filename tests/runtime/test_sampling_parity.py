"""Token choice through the in-flight executor against transformers' `generate()` on the fixture model: greedy,
temperature, top-k, top-p, min_length (transformers' min_new_tokens), repetition penalty (its processor), and
presence/frequency penalties (TensorRT-LLM's rule, which transformers lacks, as a processor that divides by the
temperature first: TensorRT-LLM applies them to logits already divided by it).

Sampled rows are drawn by the Gumbel-max rule with noise from the request's seed (trtglm.runtime.gumbel), so the
reference is transformers' own processors and warpers (temperature, top-k, top-p) choosing the distribution, then
`SeededNoise` adding the same noise to its log-probabilities, with do_sample off: its argmax is the token that the
same draw takes from transformers' distribution. The noise itself is checked to sample the right distribution in
test_sampling.py."""

from __future__ import annotations

import pytest
import torch
from support.references import four_prompts, glm_reference, tp1_model  # noqa: F401 (fixtures)
from support.tokenizer import tok  # noqa: F401 (fixture)

from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.executor import Executor, Request
from trtglm.runtime.gumbel import gumbel_noise
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


class SeededNoise:
    """The last processor of a sampled reference: log-probabilities of the warped scores plus the Gumbel noise the
    executor draws for `seed` at this step (the count of tokens generated so far)."""

    def __init__(self, seed: int, prompt_length: int):
        self.seed, self.prompt_length = seed, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        drawn = torch.tensor([input_ids.shape[1] - self.prompt_length])
        noise = gumbel_noise(torch.tensor([self.seed]), drawn, torch.arange(scores.shape[-1]))
        return torch.log_softmax(scores.float(), dim=-1) + noise


def executor_tokens(model, prompts, **settings) -> list[list[int]]:
    """Every prompt's tokens, all requests in flight together (seed i for prompt i when sampling)."""
    executor, outputs = Executor(ShardedSlotModel(model, num_slots=len(prompts), max_seq_len=256)), []
    end_id, stop_words = settings.pop("end_id", None), settings.pop("stop_words", ())
    for i, prompt in enumerate(prompts):
        outputs.append([])
        sampling = SamplingConfig(seed=i, **settings)
        executor.submit(Request(prompt, NEW, end_id=end_id, stop_words=stop_words, sampling=sampling),
                        outputs[-1].append)
    while executor.has_work():
        executor.step()
    return [[t for output in out for t in output.tokens] for out in outputs]


def transformers_tokens(reference, prompt, seed=None, end_id=None, stop_id=None, processors=(), temperature=0.0,
                        top_k=0, top_p=1.0, **builtins) -> list[int]:
    """transformers' generate() of `prompt`, greedy over: its built-in processors (`builtins`: min_new_tokens,
    repetition_penalty), `processors`, its temperature, top-k and top-p warpers, and (with a seed: sampled) the
    seed's noise. It stops after `end_id` (not returned, as the executor's end id) or `stop_id` (returned)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors = list(processors)
    processors += [TemperatureLogitsWarper(temperature)] if temperature > 0 else []
    processors += [TopKLogitsWarper(top_k)] if top_k else []
    processors += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    processors += [SeededNoise(seed, len(prompt))] if seed is not None else []
    ends = [e for e in (end_id, stop_id) if e is not None]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW, do_sample=False, logits_processor=LogitsProcessorList(processors),
                                 eos_token_id=ends or None, pad_token_id=0, **builtins)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(end_id)] if end_id in new else new


def seed_if_sampled(settings: dict, seed: int) -> int | None:
    return seed if settings.get("temperature", 0) > 0 else None


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
        expected = transformers_tokens(glm_reference, prompt, seed_if_sampled(settings, seed), **settings)
        assert tokens == expected, (name, seed)
    if settings:
        assert ours != executor_tokens(tp1_model, four_prompts)  # the setting changed the replies


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_presence_and_frequency_penalties_are_tensorrt_llms(tp1_model, glm_reference, four_prompts, temperature):
    ours = executor_tokens(tp1_model, four_prompts, temperature=temperature, presence_penalty=0.8,
                           frequency_penalty=0.5)
    penalties = TensorRTLLMPenalties(0.8, 0.5, temperature or 1.0)  # it divides by the temperature itself
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, ours)):
        sampled = seed if temperature else None
        assert tokens == transformers_tokens(glm_reference, prompt, sampled, processors=[penalties])
    assert ours != executor_tokens(tp1_model, four_prompts, temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_min_length_is_transformers_min_new_tokens(tp1_model, glm_reference, four_prompts, tok, temperature):
    """With the end id the replies reach early (the fixture's <|user|>), min_tokens holds it back as
    min_new_tokens does."""
    end_id, settings = tok.special_ids["<|user|>"], {"temperature": temperature} if temperature else {}
    free = executor_tokens(tp1_model, four_prompts, end_id=end_id, **settings)
    held = executor_tokens(tp1_model, four_prompts, end_id=end_id, min_tokens=15, **settings)
    assert any(len(tokens) < 15 for tokens in free) and all(len(tokens) >= 15 for tokens in held)
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, held)):
        assert tokens == transformers_tokens(glm_reference, prompt, seed_if_sampled(settings, seed), end_id=end_id,
                                             min_new_tokens=15, **settings)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_min_length_holds_back_one_token_stop_words(tp1_model, glm_reference, four_prompts, tok, temperature):
    """ChatGLM3's <|user|> as a stop word (as preprocessing sends it) is held back until min_tokens as the end
    id is: transformers' min_new_tokens over both as end ids. The stop word, when it comes, is returned."""
    user, end_id = tok.special_ids["<|user|>"], tok.eos_id
    settings = {"temperature": temperature} if temperature else {}
    free = executor_tokens(tp1_model, four_prompts, end_id=end_id, stop_words=[[user]], **settings)
    held = executor_tokens(tp1_model, four_prompts, end_id=end_id, stop_words=[[user]], min_tokens=15, **settings)
    assert any(len(tokens) < 15 for tokens in free) and all(len(tokens) >= 15 for tokens in held)
    for seed, (prompt, tokens) in enumerate(zip(four_prompts, held)):
        assert tokens == transformers_tokens(glm_reference, prompt, seed_if_sampled(settings, seed), end_id=end_id,
                                             stop_id=user, min_new_tokens=15, **settings), seed


MIXED = [SamplingConfig(), SamplingConfig(temperature=1.5, seed=3), SamplingConfig(temperature=2.0, top_k=20, seed=4),
         SamplingConfig(temperature=3.0, top_p=0.7, seed=5), SamplingConfig(repetition_penalty=1.3),
         SamplingConfig(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.5, seed=6)]


def test_a_mixed_batch_gives_each_request_its_tokens_alone(tp1_model, four_prompts, tok):
    """Greedy, sampled, top-k, top-p, penalised, banned and log-prob requests in flight together, each as it
    is answered alone (same seed, same tokens; greedy ones as transformers' greedy, checked above)."""
    requests = [Request(four_prompts[i % 4], NEW, sampling=sampling) for i, sampling in enumerate(MIXED)]
    requests += [Request(four_prompts[0], NEW, bad_words=[[tok.special_ids["<|user|>"]], [13, 281]]),
                 Request(four_prompts[1], NEW, output=OutputConfig(return_log_probs=True),
                         sampling=SamplingConfig(temperature=0.9, top_p=0.9, seed=7))]

    def answers(batch: list[Request]) -> list[tuple[list[int], list[float]]]:
        executor = Executor(ShardedSlotModel(tp1_model, num_slots=len(batch), max_seq_len=256))
        outputs = [[] for _ in batch]
        for request, out in zip(batch, outputs):
            executor.submit(request, out.append)
        while executor.has_work():
            executor.step()
        return [([t for o in out for t in o.tokens], [p for o in out for p in o.log_probs]) for out in outputs]

    together = answers(requests)
    for request, (tokens, log_probs) in zip(requests, together):
        alone_tokens, alone_log_probs = answers([request])[0]
        assert tokens == alone_tokens
        assert log_probs == pytest.approx(alone_log_probs, abs=1e-5) and len(log_probs) == (
            len(tokens) if request.output.return_log_probs else 0)
    assert len({tuple(tokens) for tokens, _ in together[1:4]}) == 3
