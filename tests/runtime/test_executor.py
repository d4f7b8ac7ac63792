"""The in-flight batching executor over the portable SlotModel, against `generate()` (each request run
alone, itself checked against transformers in test_runtime.py) and against independently computed
expectations: interleaved arrivals, the queue bound, cancellation, stop and bad words, seeds, log
probabilities, min_length, embedding bias, model failures and the background thread."""

from __future__ import annotations

import json
import threading
from itertools import pairwise

import pytest
import torch
from support.cli_calls import convert_checkpoint
from support.references import reordered_float32_atol

from trtglm.chatglm.chat import chat_ids, stop_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.executor import Executor
from trtglm.runtime.request import ExecutorStopped, KvBlocks, Output, QueueFullError, Request
from trtglm.runtime.generate import full_logits, generate
from trtglm.runtime.model import load_model
from trtglm.runtime.slot_runtime import ShardedSlotModel
from trtglm.runtime.slots import filled_pieces

MAX_SEQ = 256


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def model(request, tmp_path_factory, fixture_dir):
    out = tmp_path_factory.mktemp("ckpt") / f"tp{request.param}"
    return load_model(convert_checkpoint(fixture_dir, out, dtype="float32", tp_size=request.param))


@pytest.fixture(scope="module")
def all_prompts(fixture_dir, tok) -> list[list[int]]:
    conversations = [json.loads(line) for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]
    return [chat_ids(tok, c["messages"]) for c in conversations]  # 57 prompts of 7 to 221 tokens


@pytest.fixture(scope="module")
def prompts(all_prompts) -> list[list[int]]:
    return all_prompts[::5][:11]  # 11 plain-answer prompts of 7 to 70+ tokens


def stops(tok: ChatGLMTokenizer) -> list[list[int]]:
    return [[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]]


class Collected:
    """Outputs of one request, as the executor delivers them."""

    def __init__(self):
        self.outputs: list[Output] = []

    def __call__(self, output: Output) -> None:
        self.outputs.append(output)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.tokens]

    @property
    def done(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def reason(self) -> str | None:
        return self.outputs[-1].reason if self.done else None


def run(executor: Executor, until=None, limit: int = 500) -> None:
    """Step until `until()` holds (default: until there is no work left)."""
    until = until or (lambda: not executor.has_work())
    for _ in range(limit):
        if until():
            return
        executor.step()
    raise AssertionError("the executor did not finish")


def alone(model, tok, prompt: list[int], max_new: int = 40) -> list[int]:
    """generate()'s tokens, with the stop token it does not return appended (the executor returns stop words)."""
    tokens = generate(model, prompt, max_new, end_id=tok.eos_id, stop_ids=stop_ids(tok)[1:])
    return tokens + [tok.special_ids["<|user|>"]] if len(tokens) < max_new else tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_interleaved_arrivals_give_each_request_its_tokens_alone(model, tok, prompts, overlap):
    executor = Executor(ShardedSlotModel(model, num_slots=3, max_seq_len=MAX_SEQ), max_queue=16, overlap=overlap)
    results = [Collected() for _ in prompts]
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4, 5, 6], 9: [7], 12: [8, 9, 10]}  # step -> requests arriving
    for step in range(400):
        for index in arrivals.get(step, []):
            executor.submit(Request(prompts[index], 40, end_id=tok.eos_id, stop_words=stops(tok)), results[index])
        if step > max(arrivals) and not executor.has_work():
            break
        executor.step()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.done and result.tokens == alone(model, tok, prompt)
        assert result.reason == "stop_word"
    stats = executor.stats()
    assert stats.max_decode_batch == 3 and stats.active == stats.queued == 0
    assert stats.generated_tokens == sum(len(r.tokens) for r in results)


def test_a_full_queue_refuses_and_frees_up(model, tok, prompts):
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ), max_queue=2)
    first, second, third = Collected(), Collected(), Collected()
    executor.submit(Request(prompts[0], 5), first)
    executor.submit(Request(prompts[1], 5), second)
    with pytest.raises(QueueFullError, match="queue is full"):
        executor.submit(Request(prompts[2], 5), third)
    executor.step()  # the first is admitted: one place in the queue is free again
    executor.submit(Request(prompts[2], 5), third)
    run(executor)
    assert all(r.done and len(r.tokens) == 5 for r in (first, second, third))
    assert executor.stats().rejected == 1


def test_cancelling_frees_the_slot_for_a_waiting_request(model, tok, prompts):
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ))
    long, waiting, asked = Collected(), Collected(), Collected()
    handle = executor.submit(Request(prompts[0], 100), long)
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), waiting)
    for _ in range(3):
        executor.step()
    assert len(long.tokens) == 3 and not waiting.outputs
    handle.cancel()
    executor.step()
    assert long.reason == "cancelled" and len(long.tokens) == 3
    assert waiting.outputs  # admitted in the same step
    flag = threading.Event()
    executor.submit(Request(prompts[2], 100), asked, is_cancelled=flag.is_set)
    run(executor, until=lambda: waiting.done)
    executor.step()  # the slot is free: the next request starts
    assert waiting.tokens == alone(model, tok, prompts[1]) and len(asked.tokens) == 1
    flag.set()  # the client went away (Triton's request.is_cancelled())
    run(executor)
    assert asked.reason == "cancelled" and len(asked.tokens) < 100
    assert executor.stats().cancelled == 2


def test_a_callback_that_fails_stops_its_request(model, tok, prompts):
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ))

    def gone(output: Output) -> None:
        raise ConnectionError("client disconnected")

    executor.submit(Request(prompts[0], 100), gone)
    other = Collected()
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), other)
    run(executor)
    assert other.tokens == alone(model, tok, prompts[1])
    assert executor.stats().generated_tokens == 1 + len(other.tokens)  # the first request stopped at once


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_stop_words_match_on_the_suffix_and_are_returned(model, tok, prompts, overlap):
    expected = alone(model, tok, prompts[3])
    assert len(expected) > 6

    def through_first(word: list[int]) -> list[int]:
        end = next(i for i in range(len(word), len(expected) + 1) if expected[i - len(word):i] == word)
        return expected[:end]

    missing = next(t for t in range(500) if [expected[3], t] != expected[3:5] and t not in expected)
    cases = {
        "two tokens": ([expected[3:5]], through_first(expected[3:5])),
        "first token only": ([[expected[3], missing]], expected),
        "one token": ([[expected[2]]], through_first(expected[2:3])),
    }
    assert len(cases["two tokens"][1]) < len(expected)
    for name, (words, wanted) in cases.items():
        executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ), overlap=overlap)
        result = Collected()
        executor.submit(Request(prompts[3], 40, end_id=tok.eos_id, stop_words=words + stops(tok)), result)
        run(executor)
        assert result.tokens == wanted, name


def test_end_id_ends_without_being_returned(model, tok, prompts):
    expected = alone(model, tok, prompts[2])
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ))
    result = Collected()
    executor.submit(Request(prompts[2], 40, end_id=expected[4]), result)
    run(executor)
    assert result.tokens == expected[:4] and result.reason == "end_id"
    assert result.outputs[-1].tokens == []


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_bad_words_are_banned(model, tok, prompts, overlap):
    expected = alone(model, tok, prompts[3])
    for words, position in (([[expected[0]]], 0), ([expected[1:3]], 2)):
        executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ), overlap=overlap)
        result = Collected()
        executor.submit(Request(prompts[3], 6, bad_words=words), result)
        run(executor)
        assert result.tokens[:position] == expected[:position]
        assert result.tokens[position] != expected[position]
        alternative = full_logits(model, prompts[3] + expected[:position])[-1].clone()
        alternative[expected[position]] = float("-inf")
        assert result.tokens[position] == int(alternative.argmax())  # the next best instead


def test_min_length_holds_back_end_id_and_bias_shifts_choices(model, tok, prompts):
    expected = alone(model, tok, prompts[1])
    user = tok.special_ids["<|user|>"]
    executor = Executor(ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ))
    plain, longer, biased = Collected(), Collected(), Collected()
    executor.submit(Request(prompts[1], 60, end_id=user), plain)
    executor.submit(Request(prompts[1], 60, end_id=user, sampling=SamplingConfig(min_tokens=len(expected) + 3)), longer)
    bias = torch.zeros(model.config.vocab_size)
    bias[7] = 1e4
    executor.submit(Request(prompts[1], 3, embedding_bias=bias), biased)
    run(executor)
    assert plain.tokens == expected[:-1] and plain.reason == "end_id"
    assert longer.tokens[:len(expected) - 1] == expected[:-1] and len(longer.tokens) >= len(expected) + 3
    assert user not in longer.tokens[:len(expected) + 3]
    assert biased.tokens == [7, 7, 7]


def test_log_probs_are_those_of_the_chosen_tokens(model, tok, prompts):
    executor = Executor(ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ))
    result = Collected()
    executor.submit(Request(prompts[4], 8, output=OutputConfig(return_log_probs=True)), result)
    executor.submit(Request(prompts[5], 8), Collected())
    run(executor)
    log_probs = [p for o in result.outputs for p in o.log_probs]
    teacher = torch.log_softmax(full_logits(model, prompts[4] + result.tokens), dim=-1)
    start = len(prompts[4]) - 1
    expected = [float(teacher[start + i, token]) for i, token in enumerate(result.tokens)]
    assert log_probs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_the_same_seed_gives_the_same_tokens_whatever_runs_beside(model, tok, prompts, overlap):
    def sampled(seed: int, company: int) -> list[int]:
        executor = Executor(ShardedSlotModel(model, num_slots=4, max_seq_len=MAX_SEQ), overlap=overlap)
        result = Collected()
        for index in range(company):
            executor.submit(Request(prompts[index + 5], 12, sampling=SamplingConfig(temperature=1.0)), Collected())
        sampled = SamplingConfig(temperature=5.0, top_k=50, top_p=0.95, seed=seed)
        executor.submit(Request(prompts[0], 12, sampling=sampled), result)
        run(executor)
        return result.tokens

    first = sampled(1234, company=0)
    assert sampled(1234, company=3) == first
    assert sampled(99, company=1) != first  # a different seed, different tokens (hot sampling)
    assert first != alone(model, tok, prompts[0])[:12]


@pytest.mark.reliability
@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_a_degenerate_request_never_hurts_the_others(model, tok, prompts, overlap):
    """A temperature of 1e-40 samples like greedy; a bias of -inf on every id ends that request alone."""
    executor = Executor(ShardedSlotModel(model, num_slots=4, max_seq_len=MAX_SEQ), overlap=overlap)
    cold, banned, plain = Collected(), Collected(), Collected()
    executor.submit(Request(prompts[2], 40, end_id=tok.eos_id, stop_words=stops(tok),
                            sampling=SamplingConfig(temperature=1e-40, top_k=5)),
                    cold)
    executor.submit(Request(prompts[3], 8, embedding_bias=torch.full((model.config.vocab_size,), float("-inf"))),
                    banned)
    executor.submit(Request(prompts[4], 40, end_id=tok.eos_id, stop_words=stops(tok)), plain)
    run(executor)
    assert cold.tokens == alone(model, tok, prompts[2])
    assert banned.reason == "error" and banned.tokens == []
    assert banned.outputs[-1].error.startswith("no next token could be chosen: every token is excluded")
    assert plain.tokens == alone(model, tok, prompts[4]) and plain.reason == "stop_word"


def test_padded_ids_past_the_tokenizer_are_never_chosen(model, tok, prompts):
    assert model.config.vocab_size > tok.vocab_size  # the fixture's engine pads 521 ids to 576
    padded = torch.zeros(model.config.vocab_size)
    padded[tok.vocab_size:] = 1e4  # the padding would win every draw
    executor = Executor(ShardedSlotModel(model, num_slots=4, max_seq_len=MAX_SEQ), vocab_limit=tok.vocab_size)
    results = [Collected() for _ in range(4)]
    executor.submit(Request(prompts[0], 16, embedding_bias=padded), results[0])
    executor.submit(Request(prompts[1], 16, sampling=SamplingConfig(temperature=100.0, seed=3)), results[1])
    executor.submit(Request(prompts[2], 16, embedding_bias=padded, sampling=SamplingConfig(temperature=1.0, seed=4)),
                    results[2])
    executor.submit(Request(prompts[3], 16, sampling=SamplingConfig(temperature=100.0, seed=5),
                            output=OutputConfig(return_log_probs=True)), results[3])
    run(executor)
    for result in results:
        assert result.reason == "length" and len(result.tokens) == 16, result.outputs[-1]
        assert max(result.tokens) < tok.vocab_size, result.tokens


def test_requests_the_model_cannot_serve_are_refused(model, tok, prompts):
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=64))
    for request, message in (
            (Request([], 4), "prompt is empty"),
            (Request(prompts[0], 0), "request_output_len must be at least 1"),
            (Request(list(range(64)), 5), r"prompt \(64 tokens\) leaves no room for a token within max_seq_len \(64\)"),
            (Request([model.config.vocab_size], 4), "outside the vocabulary"),
            (Request([1, 2], 4, sampling=SamplingConfig(top_p=0.0)), "runtime_top_p")):
        with pytest.raises(UsageError, match=message):
            executor.submit(request, Collected())
    assert not executor.has_work()


# --- chunked prefill ---------------------------------------------------------------------------------------------

def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_prefill(model, prompts):
    slots = ShardedSlotModel(model, num_slots=3, max_seq_len=MAX_SEQ)
    prompt = max(prompts, key=len)
    whole = slots.prefill([0], [prompt])[0]
    next_token = int(whole.argmax())
    after_whole = slots.decode([0], [next_token])[0]
    teacher = full_logits(model, prompt)
    atol = reordered_float32_atol(model.config, teacher)  # chunks add up in another order than one pass
    for cuts in ([1], [5], [1, 2, 3], [7, 8, 20], [len(prompt) - 1]):
        bounds = [0, *cuts, len(prompt)]
        for start, end in pairwise(bounds):
            logits = slots.prefill([1], [prompt[start:end]], starts=[start])[0]
            torch.testing.assert_close(logits, teacher[end - 1], rtol=0, atol=atol)
        torch.testing.assert_close(logits, whole, rtol=0, atol=atol)
        torch.testing.assert_close(slots.decode([1], [next_token])[0], after_whole, rtol=0, atol=atol)
    # chunks of two prompts and a fresh prompt in one call
    other = prompts[5]
    slots.prefill([1, 2], [prompt[:6], other[:4]])
    logits = slots.prefill([2, 0, 1], [other[4:], prompts[4], prompt[6:]], starts=[4, 0, 6])
    torch.testing.assert_close(logits[0], full_logits(model, other)[-1], rtol=0, atol=atol)
    torch.testing.assert_close(logits[1], full_logits(model, prompts[4])[-1], rtol=0, atol=atol)
    torch.testing.assert_close(logits[2], whole, rtol=0, atol=atol)


def test_a_chunk_must_continue_where_its_slot_ends(model, prompts):
    slots = ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ)
    slots.prefill([0], [prompts[0][:5]])
    for starts, message in (([3], "slot 0 holds 5 positions: a prefill continuing it starts at 5, not 3"),
                            ([6], "starts at 5, not 6"), ([-1], "negative"), ([5, 0], "1 prompts but 2 starts")):
        with pytest.raises(UsageError, match=message):
            slots.prefill([0], [prompts[0][5:]], starts=starts)
    with pytest.raises(UsageError, match="slot 1 holds 0 positions"):
        slots.prefill([1], [prompts[0][5:]], starts=[5])
    with pytest.raises(UsageError, match=f"needs 1 to {MAX_SEQ - 5} tokens"):
        slots.prefill([0], [[1] * (MAX_SEQ - 4)], starts=[5])
    assert slots.cache.lengths[:2] == [5, 0]  # a refused call changes nothing
    slots.prefill([0], [prompts[0][5:]], starts=[5])
    slots.release(0)
    with pytest.raises(UsageError, match="slot 0 holds 0 positions"):
        slots.prefill([0], [[1]], starts=[len(prompts[0])])


class Recording:
    """A SlotModel that records its calls: ("prefill" or "step", slots, starts, lengths), ("decode", slots),
    ("reuse", slot, source, length), ("release", slot)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.vocab_size, self.num_slots, self.max_seq_len = inner.vocab_size, inner.num_slots, inner.max_seq_len
        self.kv_tokens = inner.kv_tokens

    def prefill(self, slots, prompts, starts=None):
        self.calls.append(("prefill", list(slots), list(starts), [len(p) for p in prompts]))
        return self.inner.prefill(slots, prompts, starts)

    def step(self, slots, pieces, starts, decode_ids=None):
        self.calls.append(("step", list(slots), list(starts), [1 if p is None else len(p) for p in pieces]))
        return self.inner.step(slots, pieces, starts, decode_ids)

    def decode(self, slots, tokens):
        self.calls.append(("decode", list(slots)))
        return self.inner.decode(slots, tokens)

    def reuse(self, slot, source, length):
        self.calls.append(("reuse", slot, source, length))
        self.inner.reuse(slot, source, length)

    def release(self, slot, keep=0):
        self.calls.append(("release", slot))
        self.inner.release(slot, keep)


def answers(executor: Executor, prompts: list[list[int]], tok) -> list[list[int]]:
    results = [Collected() for _ in prompts]
    for prompt, result in zip(prompts, results):
        executor.submit(Request(prompt, 40, end_id=tok.eos_id, stop_words=stops(tok)), result)
    run(executor, limit=5000)
    assert all(r.done for r in results)
    return [r.tokens for r in results]


def test_chunked_prefill_gives_every_conversation_its_unchunked_answer(model, tok, all_prompts):
    def executor(max_num_tokens: int) -> Executor:
        return Executor(Recording(ShardedSlotModel(model, num_slots=4, max_seq_len=320)), max_queue=len(all_prompts),
                        max_num_tokens=max_num_tokens)

    whole, chunked = executor(4 * 320), executor(5)  # whole: every slot's longest prompt fits one step
    assert answers(chunked, all_prompts, tok) == answers(whole, all_prompts, tok)
    steps = [call for call in chunked.model.calls if call[0] in ("prefill", "step")]
    assert all(sum(lengths) <= 5 for _, _, _, lengths in steps)  # decode and prompt tokens within the budget
    stats = chunked.stats()
    assert stats.prefill_tokens == sum(map(len, all_prompts)) and stats.reused_tokens == 0
    assert stats.prefill_chunks > len(all_prompts) and stats.max_decode_batch == 4
    assert whole.stats().prefill_chunks == len(all_prompts)


def test_each_step_is_one_pass_of_the_decode_tokens_and_what_is_left_of_the_budget(model, tok, all_prompts, reference):
    recording = Recording(ShardedSlotModel(model, num_slots=2, max_seq_len=320))
    executor = Executor(recording, max_num_tokens=16)
    short, long = Collected(), Collected()
    long_prompt = max(all_prompts, key=len)
    executor.submit(Request(all_prompts[0], 60), short)
    run(executor, until=lambda: bool(short.tokens))
    recording.calls.clear()
    executor.submit(Request(long_prompt, 5), long)
    steps = 0
    while not long.tokens:
        executor.step()
        steps += 1
    chunks = -(-len(long_prompt) // 15)  # one of the 16 tokens of each step is the running request's
    assert steps == chunks and len(short.tokens) == 1 + chunks  # the running request got a token every step
    short_starts = range(len(all_prompts[0]), len(all_prompts[0]) + chunks)
    long_starts = range(0, len(long_prompt), 15)
    lengths = [min(15, len(long_prompt) - start) for start in long_starts]
    assert recording.calls == [("step", [0, 1], [a, b], [1, n]) for a, b, n in zip(short_starts, long_starts, lengths)]
    run(executor)
    assert long.tokens == alone(model, tok, long_prompt, 5)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([long_prompt]), max_new_tokens=5, min_new_tokens=5,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert long.tokens == expected[0, len(long_prompt):].tolist()


def test_prompts_are_prefilled_oldest_first_within_the_budget(model, tok, all_prompts):
    recording = Recording(ShardedSlotModel(model, num_slots=3, max_seq_len=320))
    executor = Executor(recording, max_num_tokens=24)
    prompts = sorted(all_prompts, key=len)[-3:]  # three long ones: each takes several steps
    results = [Collected() for _ in prompts]
    for prompt, result in zip(prompts, results):
        executor.submit(Request(prompt, 8), result)
    prefilled, firsts, owners, admitted = [0, 0, 0], [], {}, 0  # owners: slot -> request (a finished one's is reused)
    while executor.has_work():
        seen = len(recording.calls)
        executor.step()
        call = next((c for c in recording.calls[seen:] if c[0] in ("prefill", "step")), None)
        if call is None:
            continue
        for slot, start in zip(call[1], call[2]):
            if start == 0:  # a prompt's first chunk: the next request in arrival order took the slot
                owners[slot], admitted = admitted, admitted + 1
        requests = [owners[slot] for slot in call[1]]
        decoding = sum(1 for r in requests if prefilled[r] == len(prompts[r]))
        assert sum(call[3]) <= max(24, decoding + 1)
        for r, length in zip(requests, call[3]):
            if prefilled[r] < len(prompts[r]):
                prefilled[r] += length
                firsts += [r] if prefilled[r] == len(prompts[r]) else []
        assert all(prefilled[i] == len(prompts[i]) for i in range(3) for j in range(i + 1, 3) if prefilled[j])
    assert firsts == [0, 1, 2]
    for prompt, result in zip(prompts, results):
        assert result.tokens == alone(model, tok, prompt, 8)[:8]


class Separate:
    """A SlotModel whose steps run each piece as a pass of its own (prefill of a chunk, or of one decode token)."""

    def __init__(self, inner):
        self.inner, self.mixed = inner, 0
        self.vocab_size, self.num_slots, self.max_seq_len = inner.vocab_size, inner.num_slots, inner.max_seq_len
        self.kv_tokens = inner.kv_tokens

    def prefill(self, slots, prompts, starts=None):
        return self.inner.prefill(slots, prompts, starts)

    def step(self, slots, pieces, starts, decode_ids=None):
        pieces = filled_pieces(pieces, decode_ids)
        self.mixed += any(len(p) == 1 and start for p, start in zip(pieces, starts)) and \
            any(len(p) > 1 for p in pieces)
        return torch.cat([self.inner.prefill([slot], [piece], [start])
                          for slot, piece, start in zip(slots, pieces, starts)])

    def decode(self, slots, tokens):
        return self.inner.decode(slots, tokens)

    def release(self, slot, keep=0):
        self.inner.release(slot, keep)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_a_mixed_pass_gives_the_tokens_of_separate_passes(model, tok, all_prompts, overlap):
    def executor(slots) -> Executor:
        return Executor(slots, max_queue=len(all_prompts), max_num_tokens=40, overlap=overlap)

    separate = Separate(ShardedSlotModel(model, num_slots=4, max_seq_len=320))
    assert answers(executor(ShardedSlotModel(model, num_slots=4, max_seq_len=320)), all_prompts, tok) == \
        answers(executor(separate), all_prompts, tok)
    assert separate.mixed > 10  # steps that carried decode tokens and prompt chunks together


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_a_full_kv_cache_keeps_requests_queued_until_a_finished_one_frees_it(model, tok, prompts, overlap):
    recording = Recording(ShardedSlotModel(model, num_slots=3, max_seq_len=MAX_SEQ))
    first, second = Collected(), Collected()
    need = [-(-(len(prompts[i]) + 40) // 16) for i in (1, 2)]
    # one request at a time
    executor = Executor(recording, max_kv_tokens=16 * max(need), tokens_per_block=16, overlap=overlap)
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), first)
    executor.submit(Request(prompts[2], 40, end_id=tok.eos_id, stop_words=stops(tok)), second)
    executor.step()
    assert executor.stats().active == 1 and executor.stats().queued == 1 and not second.outputs
    # the first holds its whole length's blocks from admission; the second waits for them
    blocks = executor.stats()
    assert (blocks.kv_blocks, blocks.kv_blocks_used, blocks.tokens_per_block, blocks.slots) == \
        (max(need), need[0], 16, 3)
    run(executor)
    assert first.tokens == alone(model, tok, prompts[1]) and second.tokens == alone(model, tok, prompts[2])
    assert executor.stats().kv_blocks_used == 0 and executor.stats().active == executor.stats().queued == 0
    assert recording.calls.index(("release", 0)) < recording.calls.index(("prefill", [0], [0], [len(prompts[2])]))
    with pytest.raises(UsageError, match=r"needs \d+ KV-cache positions .* the cache holds"):
        executor.submit(Request(prompts[0], MAX_SEQ), Collected())


def test_cancelling_a_request_mid_prefill_frees_its_slot(model, tok, prompts):
    recording = Recording(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ))
    executor = Executor(recording, max_num_tokens=5)
    long, waiting = Collected(), Collected()
    handle = executor.submit(Request(prompts[2], 10), long)
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), waiting)
    executor.step()
    executor.step()
    assert not long.outputs and executor.stats().active == 1 and executor.stats().queued == 1
    handle.cancel()
    executor.step()
    assert long.outputs == [Output([], finished=True, reason="cancelled")]
    assert recording.calls[2:4] == [("release", 0), ("prefill", [0], [0], [5])]  # the waiting one starts at once
    run(executor)
    assert waiting.tokens == alone(model, tok, prompts[1])
    assert executor.stats().cancelled == 1


class DecodeInputs(Recording):
    """A Recording that also keeps the type of each decode's tokens."""

    def decode(self, slots, tokens):
        self.calls.append(("decode tokens", type(tokens)))
        return super().decode(slots, tokens)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_overlapped_steps_hand_out_a_step_late_and_feed_tokens_on_the_device(model, tok, prompts, overlap):
    """Overlapped, a step hands out the tokens of the step before, and a request ended by its stop word runs one
    more token that is never sent; either way a decode's input tokens never pass through the host."""
    recording = DecodeInputs(ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ))
    executor, result = Executor(recording, overlap=overlap), Collected()
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), result)
    executor.step()  # the prompt
    assert len(result.tokens) == (0 if overlap else 1)
    executor.step()
    assert len(result.tokens) == (1 if overlap else 2)
    run(executor)
    assert result.tokens == alone(model, tok, prompts[1]) and result.reason == "stop_word"
    decodes = [call for call in recording.calls if call[0] == "decode"]
    assert len(decodes) == len(result.tokens) - (not overlap)  # the first token is the prompt's
    assert {call[1] for call in recording.calls if call[0] == "decode tokens"} == {torch.Tensor}
    # The decode-only steps: those that ran a decode pass (overlapped: after one), not the one after the prompt's.
    stats = executor.stats()
    assert stats.decode_only_steps == len(decodes) - overlap and 0 < stats.decode_only_us <= stats.step_us


def test_a_request_cancelled_with_a_token_on_the_way_never_gets_it(model, tok, prompts):
    executor, long, other = Executor(ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ), overlap=True), \
        Collected(), Collected()
    handle = executor.submit(Request(prompts[0], 100), long)
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), other)
    for _ in range(3):
        executor.step()  # two tokens handed out, the third launched
    assert len(long.tokens) == 2
    handle.cancel()
    executor.step()
    assert long.outputs[-1] == Output([], finished=True, reason="cancelled") and len(long.tokens) == 2
    run(executor)
    assert other.tokens == alone(model, tok, prompts[1]) and len(long.outputs) == 3


def test_the_step_budget_and_the_kv_cache_must_be_positive(model):
    for name in ("max_num_tokens", "max_kv_tokens", "tokens_per_block"):
        with pytest.raises(UsageError, match=f"{name} must be >= 1, not 0"):
            Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ), **{name: 0})


# --- prefix caching ----------------------------------------------------------------------------------------------


def shared_prefix_prompts(all_prompts, prefix_len: int = 100) -> list[list[int]]:
    """The first `prefix_len` tokens of the longest conversation, then each of six others."""
    prefix = max(all_prompts, key=len)[:prefix_len]
    return [prefix + p for p in all_prompts[1:31:5]]


def served_one_at_a_time(executor: Executor, prompts, tok) -> list[list[int]]:
    return [answers(executor, [prompt], tok)[0] for prompt in prompts]


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_a_shared_prefix_is_reused_with_the_tokens_it_gives_computed(model, tok, all_prompts, overlap):
    prompts = shared_prefix_prompts(all_prompts)

    def executor(reuse: bool) -> Executor:
        return Executor(Recording(ShardedSlotModel(model, num_slots=2, max_seq_len=320)), max_queue=8,
                        tokens_per_block=16, kv_cache_reuse=reuse, overlap=overlap)

    off, on = executor(False), executor(True)
    expected = served_one_at_a_time(off, prompts, tok)
    assert served_one_at_a_time(on, prompts, tok) == expected
    reused = 96 * (len(prompts) - 1)  # the prefix's 6 whole blocks of 16, for every request after the first
    assert on.stats().reused_tokens == reused and off.stats().reused_tokens == 0
    assert on.scheduler.retained and on.stats().kv_blocks_used == 0  # a finished request's kept prompt counts as free
    assert on.stats().prefill_tokens == off.stats().prefill_tokens - reused == sum(map(len, prompts)) - reused
    assert all(call[1] == call[2] for call in on.model.calls if call[0] == "reuse")  # kept in place: no copy
    beside = executor(True)  # the second arrives while the first runs: the first's blocks are copied
    first, second = Collected(), Collected()
    beside.submit(Request(prompts[0], 40, end_id=tok.eos_id, stop_words=stops(tok)), first)
    beside.step()
    beside.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), second)
    run(beside)
    assert [first.tokens, second.tokens] == expected[:2]
    assert [call for call in beside.model.calls if call[0] == "reuse"] == [("reuse", 1, 0, 96)]
    # Each output counts the blocks of 16 its request's positions take so far, the prefix's 6 reused in the second.
    for collected, prompt, reused in ((first, prompts[0], 0), (second, prompts[1], 6)):
        taken, generated = [], 0
        for output in collected.outputs:
            generated += len(output.tokens)
            taken.append(output.kv_blocks)
        assert taken[-1] == KvBlocks(-(-(len(prompt) + generated) // 16), reused)
        assert [blocks.total for blocks in taken] == sorted(blocks.total for blocks in taken)
        assert {blocks.reused for blocks in taken} == {reused} and taken[-1].new == taken[-1].total - reused


def test_evicted_prefixes_are_computed_again_and_give_the_same_tokens(model, tok, all_prompts):
    """Two slots, three prefixes: the least recently used slot's blocks go first."""
    longest = max(all_prompts, key=len)
    a, b, c = (longest[i * 64:(i + 1) * 64] + all_prompts[5] for i in range(3))
    order = [a, b, a, c, b, a]

    def executor(reuse: bool) -> Executor:
        return Executor(ShardedSlotModel(model, num_slots=2, max_seq_len=320), tokens_per_block=16,
                        kv_cache_reuse=reuse)

    on = executor(True)
    assert served_one_at_a_time(on, order, tok) == served_one_at_a_time(executor(False), order, tok)
    assert on.stats().reused_tokens == 64  # the second a only: c evicts b, b evicts a, a evicts c


class Failing:
    """A SlotModel whose decode fails once."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False
        self.vocab_size, self.num_slots, self.max_seq_len = inner.vocab_size, inner.num_slots, inner.max_seq_len
        self.kv_tokens = inner.kv_tokens

    def prefill(self, slots, prompts, starts=None):
        return self.inner.prefill(slots, prompts, starts)

    def step(self, slots, pieces, starts, decode_ids=None):
        return self.inner.step(slots, pieces, starts, decode_ids)

    def decode(self, slots, tokens):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return self.inner.decode(slots, tokens)

    def release(self, slot, keep=0):
        self.inner.release(slot, keep)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_a_model_failure_ends_the_running_requests_with_an_error_and_serving_goes_on(model, tok, prompts, overlap):
    executor = Executor(Failing(ShardedSlotModel(model, num_slots=2, max_seq_len=MAX_SEQ)), overlap=overlap)
    first, later = Collected(), Collected()
    executor.submit(Request(prompts[0], 10), first)
    executor.step()  # prefill
    executor.step()  # decode fails
    assert first.reason == "error" and "device lost" in first.outputs[-1].error
    executor.submit(Request(prompts[1], 40, end_id=tok.eos_id, stop_words=stops(tok)), later)
    run(executor)
    assert later.tokens == alone(model, tok, prompts[1])


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlapped"])
def test_background_thread_serves_concurrent_submitters_and_stop_ends_the_rest(model, tok, prompts, overlap):
    executor = Executor(ShardedSlotModel(model, num_slots=4, max_seq_len=MAX_SEQ), max_queue=32, overlap=overlap)
    executor.start()
    results = [Collected() for _ in prompts]
    handles = []

    def client(index: int) -> None:
        handles.append(executor.submit(Request(prompts[index], 40, end_id=tok.eos_id, stop_words=stops(tok)),
                                       results[index]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for handle in handles:
        assert handle.done.wait(60)
    assert [r.tokens for r in results] == [alone(model, tok, p) for p in prompts]
    assert executor.stats().max_decode_batch > 1

    left = Collected()
    executor.submit(Request(prompts[0], 200), left)
    executor.stop()
    assert left.reason == "error" and "shutting down" in left.outputs[-1].error
    with pytest.raises(ExecutorStopped):
        executor.submit(Request(prompts[0], 5), Collected())


@pytest.fixture(scope="module")
def reference(fixture_dir):
    """transformers' GlmForCausalLM with the fixture's weights."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.reference import load_reference
    from trtglm.chatglm.weights import HFWeights

    return load_reference(ChatGLMConfig.from_model_dir(fixture_dir), HFWeights(fixture_dir).get, torch.float32).eval()


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_with_a_repetition_penalty_gives_transformers_tokens(model, reference, prompts, penalty):
    """The same ids as transformers' generate() with the same repetition_penalty (its processor counts the prompt
    too, as TensorRT-LLM does); no end id, so both run the whole length."""
    executor, new = Executor(ShardedSlotModel(model, num_slots=3, max_seq_len=MAX_SEQ)), 24
    runs = [(prompt, Collected()) for prompt in prompts[:3]]
    for prompt, collected in runs:
        executor.submit(Request(prompt, new, sampling=SamplingConfig(repetition_penalty=penalty)), collected)
    run(executor)
    for prompt, collected in runs:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert collected.tokens == expected
    plains = [(prompt, Collected()) for prompt in prompts[:3]]
    for prompt, collected in plains:
        executor.submit(Request(prompt, new), collected)
    run(executor)
    assert [c.tokens for _, c in plains] != [c.tokens for _, c in runs]  # the penalty changed a reply


def test_a_repetition_penalty_of_zero_is_refused(model, prompts):
    with pytest.raises(UsageError, match="repetition_penalty must be a finite number greater than 0"):
        Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ)).submit(
            Request(prompts[0], 4, sampling=SamplingConfig(repetition_penalty=0.0)), Collected())


def test_an_output_length_past_max_seq_len_is_cut_to_what_fits(model, prompts):
    """As TensorRT-LLM's executor: the request is not refused; it generates up to max_seq_len and ends by length."""
    executor = Executor(ShardedSlotModel(model, num_slots=1, max_seq_len=MAX_SEQ))
    collected = Collected()
    executor.submit(Request(prompts[0], 10_000), collected)
    run(executor, limit=MAX_SEQ + 10)
    assert len(collected.tokens) == MAX_SEQ - len(prompts[0]) and collected.reason == "length"
