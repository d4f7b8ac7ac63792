"""The scheduler alone, without a model: what a step runs within its budget, admission by free slots and KV-cache
room, prefix reuse and eviction, beam searches' slots, cancellation and giving back. The slots' caches are a
recorder of the calls the scheduler makes on them (the model's `reuse` and `release`)."""

from __future__ import annotations

import pytest

from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig
from trtglm.runtime.request import Handle, QueueFullError, Request
from trtglm.runtime.scheduler import Scheduler, StepPlan
from trtglm.runtime.sequence import SequenceState

BLOCK = 4  # tokens per KV-cache block


class RecordedCaches:
    """The calls the scheduler makes on the slots' caches, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def reuse(self, slot: int, source: int, length: int) -> None:
        self.calls.append(("reuse", slot, source, length))

    def release(self, slot: int, keep: int = 0) -> None:
        self.calls.append(("release", slot, keep))


def create_scheduler(num_slots: int = 4, kv_blocks: int = 64, max_queue: int = 16,
                     kv_cache_reuse: bool = False) -> Scheduler:
    return Scheduler(RecordedCaches(), num_slots, kv_blocks, BLOCK, max_queue, kv_cache_reuse)


def create_sequence(number: int, prompt: int | list[int], max_tokens: int = 8, **options) -> SequenceState:
    """Request `number` of a prompt (`prompt` tokens 1, 2, … or the list given)."""
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return SequenceState(Handle(number), Request(prompt, max_tokens, **options), lambda output: None)


def submitted(scheduler: Scheduler, *sequences: SequenceState) -> list[SequenceState]:
    for sequence in sequences:
        scheduler.submit(sequence)
    return list(sequences)


def run(scheduler: Scheduler, budget: int) -> StepPlan:
    """Schedule a step and record its prompt chunks as prefilled, as the executor does once its pass is launched."""
    plan = scheduler.schedule(budget)
    for sequence, length in plan.chunks:
        scheduler.prefilled(sequence, length)
    return plan


def chunk_lengths(plan: StepPlan) -> list[tuple[int, int]]:
    return [(sequence.handle.id, length) for sequence, length in plan.chunks]


def test_decode_tokens_go_first_and_prompts_fill_the_rest_of_the_budget_oldest_first():
    scheduler = create_scheduler()
    first, second, third = submitted(scheduler, create_sequence(0, 6), create_sequence(1, 5), create_sequence(2, 30))
    plan = run(scheduler, 16)
    assert plan.decoding == [] and plan.admitted == [first, second, third]
    assert chunk_lengths(plan) == [(0, 6), (1, 5), (2, 5)] and plan.prompt_tokens == 16
    plan = run(scheduler, 16)  # two decode tokens, and the third prompt's next chunk in what is left
    assert plan.decoding == [first, second] and plan.decode_tokens == 2 and plan.admitted == []
    assert chunk_lengths(plan) == [(2, 14)]
    plan = run(scheduler, 16)
    assert plan.decoding == [first, second] and chunk_lengths(plan) == [(2, 11)]
    assert run(scheduler, 16).decoding == [first, second, third]


def test_a_full_budget_of_decode_tokens_still_takes_one_prompt_token():
    scheduler = create_scheduler(num_slots=3)
    submitted(scheduler, create_sequence(0, 2), create_sequence(1, 2))
    run(scheduler, 4)
    submitted(scheduler, create_sequence(2, 5))
    plan = run(scheduler, 2)
    assert plan.decode_tokens == 2 and chunk_lengths(plan) == [(2, 1)]


def test_a_request_waits_for_a_free_slot_and_kv_cache_room_in_arrival_order():
    scheduler = create_scheduler(num_slots=2, kv_blocks=6)  # a request of 4 + 8 positions takes 3 blocks
    first, second, third, small = submitted(scheduler, *(create_sequence(n, 4) for n in range(3)),
                                            create_sequence(3, 1, max_tokens=1))
    assert run(scheduler, 64).admitted == [first, second]
    assert scheduler.free_kv_blocks == 0 and list(scheduler.waiting) == [third, small]
    assert run(scheduler, 64).admitted == []  # no slot: even the small one behind waits its turn
    assert scheduler.release(first) and scheduler.free_kv_blocks == 3
    assert run(scheduler, 64).admitted == [third]
    assert not scheduler.release(first)  # given back once
    assert scheduler.cache.calls == [("release", first.slot, 0)]


def test_the_kv_cache_holds_a_request_back_while_a_slot_is_free():
    scheduler = create_scheduler(num_slots=4, kv_blocks=5)
    first, second = submitted(scheduler, create_sequence(0, 4), create_sequence(1, 4))
    assert run(scheduler, 64).admitted == [first]
    assert list(scheduler.waiting) == [second] and len(scheduler.running) == 1


def test_a_full_queue_refuses_and_a_request_that_never_fits_is_refused_at_once():
    scheduler = create_scheduler(kv_blocks=4, max_queue=1)
    scheduler.submit(create_sequence(0, 4))
    with pytest.raises(QueueFullError, match="1 requests already wait for the 4 slots"):
        scheduler.submit(create_sequence(1, 4))
    scheduler.check(Request([1] * 8, 8))  # 16 positions: 4 blocks
    with pytest.raises(UsageError, match="needs 20 KV-cache positions .* the cache holds 16"):
        scheduler.check(Request([1] * 9, 8))


def test_a_cached_prefix_is_reused_and_evicted_least_recently_released_first():
    scheduler = create_scheduler(num_slots=3, kv_blocks=12, kv_cache_reuse=True)
    shared = list(range(1, 10))  # two whole blocks, and one token more
    first, other = submitted(scheduler, create_sequence(0, shared, max_tokens=3),
                             create_sequence(1, [50 + t for t in range(9)], max_tokens=3))
    run(scheduler, 64)
    for sequence in (first, other):
        assert scheduler.release(sequence)
    assert scheduler.retained == {first.slot: 2, other.slot: 2} and scheduler.free_kv_blocks == 8
    follower, = submitted(scheduler, create_sequence(2, shared[:8] + [99, 98], max_tokens=2))
    plan = run(scheduler, 64)
    assert plan.admitted == [follower] and plan.reused_tokens == 8 and follower.reused_blocks == 2
    assert follower.slot == first.slot and chunk_lengths(plan) == [(2, 2)]  # kept in place: nothing copied
    assert scheduler.cache.calls[-1] == ("reuse", first.slot, first.slot, 8)
    assert scheduler.retained == {other.slot: 2}
    # 12 blocks: the follower's 3 and the other's 2 retained leave 7; a request of 8 evicts the other's prompt
    big, = submitted(scheduler, create_sequence(3, [7] * 20, max_tokens=12))
    calls = len(scheduler.cache.calls)
    assert run(scheduler, 64).admitted == [big] and scheduler.retained == {}
    assert scheduler.cache.calls[calls] == ("release", other.slot, 0)
    assert scheduler.free_kv_blocks == 12 - 3 - 8


def test_a_prefix_held_by_a_busy_slot_is_copied_into_a_free_one():
    scheduler = create_scheduler(num_slots=2, kv_cache_reuse=True)
    shared = list(range(1, 10))
    first, = submitted(scheduler, create_sequence(0, shared))
    run(scheduler, 64)
    second, = submitted(scheduler, create_sequence(1, shared))
    plan = run(scheduler, 64)
    assert plan.admitted == [second] and second.slot != first.slot
    assert scheduler.cache.calls == [("reuse", second.slot, first.slot, 8)] and chunk_lengths(plan) == [(1, 1)]


def test_context_logits_are_never_taken_from_the_prefix_cache():
    scheduler = create_scheduler(num_slots=2, kv_cache_reuse=True)
    shared = list(range(1, 10))
    submitted(scheduler, create_sequence(0, shared))
    run(scheduler, 64)
    asking, = submitted(scheduler, create_sequence(1, shared, output=OutputConfig(return_context_logits=True)))
    plan = run(scheduler, 64)
    assert plan.reused_tokens == 0 and chunk_lengths(plan) == [(1, len(shared))] and scheduler.cache.calls == []


def test_a_beam_search_takes_a_slot_and_its_blocks_for_every_beam_and_gives_them_back():
    scheduler = create_scheduler(num_slots=4, kv_blocks=12)
    beams, waiting = submitted(scheduler, create_sequence(0, 4, sampling=SamplingConfig(beam_width=3)),
                               create_sequence(1, 4, sampling=SamplingConfig(beam_width=2)))
    plan = run(scheduler, 64)
    assert plan.admitted == [beams] and list(scheduler.waiting) == [waiting]  # one slot left for two beams
    assert beams.beams.slots == [beams.slot, *beams.held] and sorted(beams.beams.slots) == [0, 1, 2]
    assert scheduler.held == {slot: beams for slot in beams.held} and scheduler.free_kv_blocks == 12 - 3 * 3
    assert run(scheduler, 64).decode_tokens == 3
    assert scheduler.release(beams) and scheduler.held == {} and scheduler.free_kv_blocks == 12
    assert sorted(call[1] for call in scheduler.cache.calls) == [0, 1, 2]


def test_cancelled_requests_are_found_running_and_taken_out_of_the_queue():
    scheduler = create_scheduler(num_slots=1)
    running, waiting, staying = submitted(scheduler, create_sequence(0, 4), create_sequence(1, 4),
                                          create_sequence(2, 4))
    run(scheduler, 64)
    running.handle.cancel()
    waiting.handle.cancel()
    assert scheduler.cancelled_running(ask=False) == [running]
    assert scheduler.take_cancelled_waiting(ask=False) == [waiting] and list(scheduler.waiting) == [staying]
    asked = create_sequence(3, 4)
    asked.is_cancelled = lambda: True  # asked only when `ask`
    scheduler.submit(asked)
    assert scheduler.take_cancelled_waiting(ask=False) == [] and scheduler.take_cancelled_waiting(ask=True) == [asked]


def test_forget_all_frees_every_slot_block_and_prefix_and_drain_empties_the_queue():
    scheduler = create_scheduler(num_slots=2, kv_blocks=8, kv_cache_reuse=True)
    first, second, third = submitted(scheduler, create_sequence(0, 9), create_sequence(1, 4), create_sequence(2, 4))
    run(scheduler, 64)
    scheduler.release(second)
    assert scheduler.forget_all() == [first] and scheduler.drain() == [third]
    assert (scheduler.running, scheduler.held, scheduler.retained, scheduler.free_kv_blocks) == ({}, {}, {}, 8)
    assert scheduler.prefixes.longest(list(range(1, 10))) is None and not scheduler.has_work()


def test_requests_that_need_the_host_between_steps_make_the_steps_run_in_turn():
    scheduler = create_scheduler()
    submitted(scheduler, create_sequence(0, 4), create_sequence(1, 4, bad_words=[[5]]))
    assert not scheduler.host_bound()
    scheduler.submit(create_sequence(2, 4, bad_words=[[5, 6]]))  # banned after its first token: known on the host
    assert scheduler.host_bound()
