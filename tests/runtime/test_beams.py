"""Beam search (trtglm.runtime.beams) in-process and through the executor, against transformers' `generate()`
with `num_beams`, `do_sample=False`, the same `length_penalty` and `early_stopping`: the same ids for every
returned beam, in the same order, with the same scores."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.references import four_prompts, glm_reference, tp1_model  # noqa: F401 (fixtures)
from support.tokenizer import tok  # noqa: F401 (fixture)

from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig, early_stopping_mode
from trtglm.runtime.generate import beam_search
from trtglm.runtime.request import KvBlocks

NEW = 20
SEARCHES = [(1.0, True), (0.0, False), (2.0, "never"), (-1.0, False)]  # (length_penalty, early_stopping)


@pytest.fixture(scope="module")
def end_id(tok) -> int:
    return tok.special_ids["<|user|>"]


class BanBeforeSoftmax:
    """TensorRT-LLM's min_length rule as a transformers logits processor: the end id is banned from the logits
    before the beam's log-softmax (transformers' own min_new_tokens bans it after, without renormalizing)."""

    def __init__(self, end_id: int, prompt_length: int, min_new: int):
        self.end_id, self.prompt_length, self.min_new = end_id, prompt_length, min_new

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - self.prompt_length >= self.min_new:
            return scores
        scores = scores.clone()
        scores[:, self.end_id] = float("-inf")
        return torch.log_softmax(scores, dim=-1)


class AdditivePenaltiesBeforeSoftmax:
    """TensorRT-LLM's presence and frequency penalties on a beam's logits, as a transformers processor of its
    log-probs: the penalties shift logits, so penalizing the log-probs and renormalizing is the same."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return torch.log_softmax(scores - self.presence * (counts > 0) - self.frequency * counts, dim=-1)


def transformers_beams(reference, prompt, width, end_id, length_penalty, early_stopping, new=NEW, min_new=0,
                       processors=()):
    """transformers' `width` beams: (generated ids, end id included, and score) best first."""
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([*processors, *([BanBeforeSoftmax(end_id, len(prompt), min_new)] if min_new
                                                     else [])])
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=new, logits_processor=processors, num_beams=width,
                                 num_return_sequences=width, do_sample=False, length_penalty=length_penalty,
                                 early_stopping=early_stopping, eos_token_id=[end_id], pad_token_id=0,
                                 return_dict_in_generate=True, output_scores=True)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    ids = [out.sequences[i, len(prompt):len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return ids, out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty, early_stopping", SEARCHES)
def test_beam_search_gives_transformers_beams(tp1_model, glm_reference, four_prompts, end_id, width, length_penalty,
                                              early_stopping):
    ended = 0
    for prompt in four_prompts:
        beams = beam_search(tp1_model, prompt, width, NEW, end_id=end_id, length_penalty=length_penalty,
                            early_stopping=early_stopping)
        ids, scores = transformers_beams(glm_reference, prompt, width, end_id, length_penalty, early_stopping)
        assert [b.tokens for b in beams] == ids
        assert [b.score for b in beams] == pytest.approx(scores, abs=1e-3)
        ended += sum(b.tokens[-1] == end_id for b in beams)
    assert ended  # some beams finished at the end id, others ran to the length limit


def test_min_length_keeps_the_end_id_away(tp1_model, glm_reference, four_prompts, end_id):
    """As TensorRT-LLM: the end id is banned before the log-softmax, so the other tokens' log probs renormalize."""
    prompt = four_prompts[0]
    free = beam_search(tp1_model, prompt, 2, NEW, end_id=end_id)
    assert len(free[0].tokens) < 15 and free[0].tokens[-1] == end_id
    held = beam_search(tp1_model, prompt, 2, NEW, end_id=end_id, min_length=15)
    ids, _ = transformers_beams(glm_reference, prompt, 2, end_id, 1.0, True, min_new=15)
    assert [b.tokens for b in held] == ids and all(len(b.tokens) >= 16 or b.tokens[-1] != end_id for b in held)


def test_width_one_is_greedy(tp1_model, four_prompts, end_id):
    from trtglm.runtime.generate import generate

    for prompt in four_prompts:
        beam, = beam_search(tp1_model, prompt, 1, NEW, end_id=end_id)
        greedy = generate(tp1_model, prompt, NEW, end_id=end_id)
        assert beam.tokens == greedy + [end_id] if len(greedy) < NEW else beam.tokens == greedy


@pytest.mark.parametrize("value, mode", [(True, True), (False, False), (1, True), (0, False), (2, "never"),
                                         ("never", "never")])
def test_early_stopping_takes_tensorrt_llms_integers(value, mode):
    assert early_stopping_mode(value) is mode if isinstance(mode, bool) else early_stopping_mode(value) == mode


def test_bad_beam_requests_are_refused(tp1_model, four_prompts):
    with pytest.raises(UsageError, match="beam_width >= 1"):
        beam_search(tp1_model, four_prompts[0], 0, NEW)
    with pytest.raises(UsageError, match="early_stopping must be"):
        early_stopping_mode("sometimes")


# --- through the executor ------------------------------------------------------------------------------------


def run_all(executor, limit: int = 500) -> None:
    for _ in range(limit):
        if not executor.has_work():
            return
        executor.step()
    raise AssertionError("the executor did not finish")


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_the_executor_answers_every_beam_with_other_requests_running(tp1_model, glm_reference, four_prompts, end_id,
                                                                     width, overlap):
    """Beam searches share the steps with greedy requests (their slots decoded together, beams copied between
    slots as they move on) and still give transformers' beams; the greedy requests give generate()'s tokens."""
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.generate import generate
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    executor = Executor(ShardedSlotModel(tp1_model, num_slots=2 * width + 2, max_seq_len=256), max_beam_width=width, overlap=overlap)
    outputs = {}
    for i, prompt in enumerate(four_prompts):
        beams = SamplingConfig(beam_width=width, length_penalty=0.5, early_stopping=0)
        executor.submit(Request(prompt, NEW, end_id=end_id, sampling=beams, output=OutputConfig(return_log_probs=True)),
                        outputs.setdefault(("beams", i), []).append)
        executor.submit(Request(prompt, NEW, end_id=end_id), outputs.setdefault(("greedy", i), []).append)
    run_all(executor)
    for i, prompt in enumerate(four_prompts):
        answer, = outputs[("beams", i)]
        ids, scores = transformers_beams(glm_reference, prompt, width, end_id, 0.5, False)
        assert [b.tokens for b in answer.beams] == [t[:-1] if t[-1] == end_id else t for t in ids]
        assert [b.score for b in answer.beams] == pytest.approx(scores, abs=1e-3)
        best = answer.beams[0]
        assert answer.finished and answer.tokens == best.tokens and answer.log_probs == best.log_probs
        assert answer.reason == ("end_id" if ids[0][-1] == end_id else "length")
        assert sum(best.log_probs) <= best.cum_log_prob + 1e-4  # the end id's log prob counts in cum_log_prob
        assert [t for o in outputs[("greedy", i)] for t in o.tokens] == generate(tp1_model, prompt, NEW, end_id=end_id)
    assert executor.stats().active == 0 and not executor.scheduler.held


def test_a_beam_search_waits_for_enough_free_slots_and_frees_them(tp1_model, four_prompts, end_id):
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    executor = Executor(ShardedSlotModel(tp1_model, num_slots=4, max_seq_len=256), max_beam_width=4)
    first, second, third = [], [], []
    executor.submit(Request(four_prompts[0], NEW, end_id=end_id), first.append)
    executor.submit(Request(four_prompts[1], NEW, end_id=end_id, sampling=SamplingConfig(beam_width=4)), second.append)
    executor.submit(Request(four_prompts[2], NEW, end_id=end_id, sampling=SamplingConfig(beam_width=2)), third.append)
    executor.step()
    assert executor.stats().active == 1 and executor.stats().queued == 2  # 3 slots free: not enough for 4 beams
    run_all(executor)
    assert len(second[-1].beams) == 4 and len(third[-1].beams) == 2
    alone = beam_search(tp1_model, four_prompts[2], 2, NEW, end_id=end_id)
    assert [b.tokens for b in third[-1].beams] == [b.tokens[:-1] if b.tokens[-1] == end_id else b.tokens for b in alone]


def test_beam_widths_past_the_limit_are_refused(tp1_model, four_prompts):
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    executor = Executor(ShardedSlotModel(tp1_model, num_slots=4, max_seq_len=256), max_beam_width=2)
    with pytest.raises(UsageError, match=r"beam_width 3 is outside 1..2 \(the engine's max_beam_width\)"):
        executor.submit(Request(four_prompts[0], NEW, sampling=SamplingConfig(beam_width=3)), lambda output: None)
    with pytest.raises(UsageError, match="max_beam_width must be 1 to the 4 slots"):
        Executor(ShardedSlotModel(tp1_model, num_slots=4, max_seq_len=256), max_beam_width=5)


def test_a_slot_copy_continues_like_the_original(tp1_model, four_prompts):
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    slots = ShardedSlotModel(tp1_model, num_slots=3, max_seq_len=256)
    slots.prefill([0, 2], [four_prompts[0], four_prompts[1]])
    slots.copy([0], [1])
    logits = slots.decode([0, 1, 2], [5, 5, 5])
    torch.testing.assert_close(logits[0], logits[1])
    assert not torch.equal(logits[0], logits[2])
    with pytest.raises(UsageError, match="one distinct target slot"):
        slots.copy([0, 1], [1, 2])


def test_beams_take_presence_and_frequency_penalties_on_each_beams_history(tp1_model, glm_reference, four_prompts,
                                                                           end_id):
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    executor = Executor(ShardedSlotModel(tp1_model, num_slots=8, max_seq_len=256), max_beam_width=2)
    answers = []
    for prompt in four_prompts:
        answers.append([])
        penalised = SamplingConfig(beam_width=2, presence_penalty=1.0, frequency_penalty=0.5)
        executor.submit(Request(prompt, NEW, end_id=end_id, sampling=penalised), answers[-1].append)
    run_all(executor)
    for prompt, (answer,) in zip(four_prompts, answers):
        ids, _ = transformers_beams(glm_reference, prompt, 2, end_id, 1.0, True,
                                    processors=[AdditivePenaltiesBeforeSoftmax(1.0, 0.5)])
        assert [b.tokens for b in answer.beams] == [t[:-1] if t[-1] == end_id else t for t in ids]
    plain = [b.tokens for b in beam_search(tp1_model, four_prompts[0], 2, NEW, end_id=end_id)]
    assert [t[:-1] if t[-1] == end_id else t for t in plain] != [b.tokens for b in answers[0][0].beams]


# --- beams in the scheduler's steps ----------------------------------------------------------------------------


class Passes:
    """A SlotModel that records its forward passes (op, slots, piece lengths) and prefix reuses."""

    def __init__(self, inner):
        self.inner, self.passes, self.reused = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, slots, prompts, starts=None):
        self.passes.append(("prefill", list(slots), [len(p) for p in prompts]))
        return self.inner.prefill(slots, prompts, starts)

    def step(self, slots, pieces, starts, decode_ids=None):
        self.passes.append(("step", list(slots), [1 if p is None else len(p) for p in pieces]))
        return self.inner.step(slots, pieces, starts, decode_ids)

    def decode(self, slots, tokens):
        self.passes.append(("decode", list(slots), [1] * len(slots)))
        return self.inner.decode(slots, tokens)

    def reuse(self, slot, source, length):
        self.reused.append(length)
        self.inner.reuse(slot, source, length)


def without_end(beams, end_id):
    return [b.tokens[:-1] if b.tokens[-1] == end_id else b.tokens for b in beams]


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_beams_decode_in_the_same_pass_as_another_requests_prompt_chunks(tp1_model, four_prompts, end_id, overlap):
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.generate import generate
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    model = Passes(ShardedSlotModel(tp1_model, num_slots=3, max_seq_len=256))
    executor = Executor(model, max_num_tokens=8, max_beam_width=2, overlap=overlap)
    beams, plain = [], []
    executor.submit(Request(four_prompts[0], NEW, end_id=end_id, sampling=SamplingConfig(beam_width=2)), beams.append)
    while not executor.stats().generated_tokens:  # its prompt in chunks of 8, then the first beam step
        executor.step()
    long_prompt = [t for p in four_prompts for t in p]
    executor.submit(Request(long_prompt, NEW, end_id=end_id), plain.append)
    run_all(executor)
    assert all(sum(lengths) <= 8 for _, _, lengths in model.passes)
    mixed = [slots for op, slots, lengths in model.passes if op == "step" and lengths == [1, 1, 6]]
    assert len(mixed) >= 3 and all(sorted(slots[:2]) == [0, 1] and slots[2] == 2 for slots in mixed)
    assert [b.tokens for b in beams[-1].beams] == \
        without_end(beam_search(tp1_model, four_prompts[0], 2, NEW, end_id=end_id), end_id)
    assert [t for o in plain for t in o.tokens] == generate(tp1_model, long_prompt, NEW, end_id=end_id)


def test_a_beam_search_reserves_kv_cache_room_for_every_beam(tp1_model, four_prompts, end_id):
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    prompt = four_prompts[0]
    blocks = -(-(len(prompt) + NEW) // 16)
    executor = Executor(ShardedSlotModel(tp1_model, num_slots=4, max_seq_len=256), max_kv_tokens=16 * 2 * blocks,
                        tokens_per_block=16, max_beam_width=2)
    plain, beams = [], []
    executor.submit(Request(prompt, NEW, end_id=end_id), plain.append)
    executor.submit(Request(prompt, NEW, end_id=end_id, sampling=SamplingConfig(beam_width=2)), beams.append)
    executor.step()
    assert executor.stats().active == 1 and executor.stats().queued == 1  # slots are free, room for one beam only
    run_all(executor)
    assert [b.tokens for b in beams[-1].beams] == without_end(beam_search(tp1_model, prompt, 2, NEW, end_id=end_id),
                                                              end_id)
    # its perf metrics count each beam's blocks: the prompt and every step the search ran
    steps = executor.stats().generated_tokens - sum(len(output.tokens) for output in plain)
    assert steps >= max(len(b.tokens) for b in beams[-1].beams)
    assert beams[-1].kv_blocks == KvBlocks(2 * -(-(len(prompt) + steps) // 16), 0)
    assert -(-(len(prompt) + steps) // 16) > -(-len(prompt) // 16)  # the steps took blocks of their own
    longer = Request(prompt, NEW + 16, end_id=end_id)
    executor.check(longer)
    with pytest.raises(UsageError, match=r"needs \d+ KV-cache positions \(prompt and output, for each beam\)"):
        executor.check(dataclasses.replace(longer, sampling=SamplingConfig(beam_width=2)))


def served_in_turn(tp1_model, prompts, widths, end_id, reuse: bool, slots: int) -> tuple[list, list[int]]:
    """Each request's answer (every beam's tokens, or the tokens) served one after the other, and the lengths of
    the prefixes reused."""
    from trtglm.runtime.executor import Executor, Request
    from trtglm.runtime.slot_runtime import ShardedSlotModel

    model = Passes(ShardedSlotModel(tp1_model, num_slots=slots, max_seq_len=256))
    executor = Executor(model, tokens_per_block=16, kv_cache_reuse=reuse, max_beam_width=2)
    answers = []
    for prompt, width in zip(prompts, widths, strict=True):
        out = []
        executor.submit(Request(prompt, NEW, end_id=end_id, sampling=SamplingConfig(beam_width=width)), out.append)
        run_all(executor)
        answers.append([b.tokens for b in out[-1].beams] or [t for o in out for t in o.tokens])
    return answers, model.reused


def test_beam_searches_reuse_a_cached_prefix_and_leave_it_valid(tp1_model, four_prompts, end_id):
    """Plain requests and beam searches in turn, sharing a prefix of two blocks: each after the first reuses it, and
    every answer is the one computed without reuse."""
    prefix = [t for p in four_prompts for t in p][:32]
    prompts, widths = [prefix + p for p in four_prompts], [1, 2, 1, 2]
    on, reused = served_in_turn(tp1_model, prompts, widths, end_id, True, slots=3)
    assert on == served_in_turn(tp1_model, prompts, widths, end_id, False, slots=3)[0] and reused == [32, 32, 32]


def test_the_slots_beams_overwrite_no_longer_offer_their_prefixes(tp1_model, four_prompts, end_id):
    """Two slots: a beam search of prefix a takes the slot that held prefix b, so b is computed again."""
    ids = [t for p in four_prompts for t in p]
    a, b = ids[:32], ids[6:38]
    prompts, widths = [a + four_prompts[0], b + four_prompts[1], a + four_prompts[2], b + four_prompts[3]], [1, 1, 2, 1]
    on, reused = served_in_turn(tp1_model, prompts, widths, end_id, True, slots=2)
    assert on == served_in_turn(tp1_model, prompts, widths, end_id, False, slots=2)[0] and reused == [32]
