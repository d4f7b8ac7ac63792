"""Context and generation logits from the in-flight executor over the portable SlotModel, against
transformers' GlmForCausalLM on the fixture: every prompt position's logits (prompts chunked, beside other
requests, with a prefix cache that holds the prompt), the raw logits each generated token was chosen from
(sampling and penalties do not touch them), nothing for requests that do not ask, and the cap on their size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.references import four_prompts, glm_reference, tp1_model  # noqa: F401 (fixtures)

from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.executor import Executor, Request
from trtglm.runtime.request import MAX_LOGITS_ENV, check_request
from trtglm.runtime.slot_runtime import ShardedSlotModel

BOTH = OutputConfig(return_context_logits=True, return_generation_logits=True)  # every logits output

NEW = 12


def reference_logits(reference, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits of every prompt position, and of the positions each of `tokens` was chosen at."""
    with torch.no_grad():
        logits = reference(torch.tensor([list(prompt) + tokens])).logits[0].float().numpy()
    return logits[:len(prompt)], logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def served(executor: Executor, requests: list[Request]) -> list[list]:
    outputs = [[] for _ in requests]
    for request, collected in zip(requests, outputs):
        executor.submit(request, collected.append)
    while executor.has_work():
        executor.step()
    return outputs


def test_context_and_generation_logits_are_transformers(tp1_model, glm_reference, four_prompts):
    """Chunked prompts (8 tokens a step) beside requests that ask for nothing, and a prefix cache that holds the
    asking request's prompt (it is computed again: every position's logits are needed)."""
    slots = ShardedSlotModel(tp1_model, num_slots=4, max_seq_len=256)
    executor = Executor(slots, max_num_tokens=8, kv_cache_reuse=True, tokens_per_block=4)
    served(executor, [Request(four_prompts[0], 2)])  # leaves the first prompt in the prefix cache
    asking = [Request(prompt, NEW, output=BOTH) for prompt in four_prompts[:2]]
    outputs = served(executor, [asking[0], Request(four_prompts[2], NEW), asking[1], Request(four_prompts[3], NEW)])
    for request, collected in zip(asking, (outputs[0], outputs[2])):
        tokens = [t for output in collected for t in output.tokens]
        context, generation = reference_logits(glm_reference, request.prompt, tokens)
        assert collected[0].context_logits.shape == (len(request.prompt), slots.vocab_size) == context.shape
        np.testing.assert_allclose(collected[0].context_logits, context, atol=2e-4)
        assert [o.context_logits is None for o in collected[1:]] == [True] * (len(collected) - 1)
        rows = np.concatenate([o.generation_logits for o in collected if o.tokens])
        assert rows.shape == (len(tokens), slots.vocab_size)
        np.testing.assert_allclose(rows, generation, atol=2e-4)
    for collected in (outputs[1], outputs[3]):
        assert all(o.context_logits is None and o.generation_logits is None for o in collected)


def test_generation_logits_are_the_raw_ones_before_penalties_and_sampling(tp1_model, glm_reference, four_prompts):
    sampling = SamplingConfig(temperature=0.7, top_k=5, seed=3, repetition_penalty=1.5, presence_penalty=0.5)
    request = Request(four_prompts[1], NEW, embedding_bias=torch.full((576,), 2.0), sampling=sampling,
                      output=OutputConfig(return_generation_logits=True))
    collected, = served(Executor(ShardedSlotModel(tp1_model, num_slots=1, max_seq_len=256)), [request])
    tokens = [t for output in collected for t in output.tokens]
    _, generation = reference_logits(glm_reference, request.prompt, tokens)
    np.testing.assert_allclose(np.concatenate([o.generation_logits for o in collected if o.tokens]), generation,
                               atol=2e-4)


def test_a_beam_search_gets_its_context_logits_and_each_beams_generation_logits(tp1_model, glm_reference,
                                                                                 four_prompts):
    """Each beam's rows follow its own tokens, whichever beams it continued on the way."""
    request = Request(four_prompts[0], 8, sampling=SamplingConfig(beam_width=3), output=BOTH)
    collected, = served(Executor(ShardedSlotModel(tp1_model, num_slots=3, max_seq_len=256), max_beam_width=3),
                        [request])
    beams = collected[-1].beams
    context, _ = reference_logits(glm_reference, request.prompt, [])
    np.testing.assert_allclose(collected[-1].context_logits, context, atol=2e-4)
    assert len({tuple(beam.tokens) for beam in beams}) == 3
    for beam in beams:
        _, generation = reference_logits(glm_reference, request.prompt, beam.tokens)
        np.testing.assert_allclose(np.stack(beam.logits), generation, atol=2e-4)


def test_a_request_that_does_not_ask_runs_no_extra_pass(tp1_model, four_prompts):
    slots = ShardedSlotModel(tp1_model, num_slots=1, max_seq_len=256)
    slots.prefill_all = None  # any call fails the request
    collected, = served(Executor(slots), [Request(four_prompts[0], 3)])
    assert collected[-1].finished and not collected[-1].error and len(collected) == 3


def test_logits_past_the_cap_are_refused_in_one_line(monkeypatch):
    """ChatGLM3's 65024-id rows: 256 MiB holds 1032 of them, context and generation together."""
    check_request(Request([1] * 1000, 32, output=BOTH), 65024, 8192)
    with pytest.raises(UsageError, match=r"^return_context_logits and return_generation_logits: 1033 rows of 65024 "
                                         r"float32 logits take 256\.2 MiB, more than the 256 MiB a request may ask "
                                         rf"for \({MAX_LOGITS_ENV}\); shorten"):
        check_request(Request([1] * 1000, 33, output=BOTH), 65024, 8192)
    check_request(Request([1] * 4000, 5000), 65024, 8192)  # asking for none: no cap
    monkeypatch.setenv(MAX_LOGITS_ENV, "1024")
    check_request(Request([1] * 4000, 5000, output=OutputConfig(return_context_logits=True)), 65024, 8192)
    monkeypatch.setenv(MAX_LOGITS_ENV, "lots")
    with pytest.raises(UsageError, match=f"^{MAX_LOGITS_ENV} must be a whole number of MiB, not 'lots'$"):
        check_request(Request([1] * 4, 5, output=OutputConfig(return_context_logits=True)), 65024, 8192)
