"""The API's admission of sequences (trtglm/openai_api/admission.py), on asyncio alone: places handed out fewest
running first, the waiting bound refusing a request whole before any of it runs, and the counts staying true
when requests end early or are cancelled while they wait."""

from __future__ import annotations

import asyncio

import pytest

from trtglm.openai_api.admission import Admission, running_limit
from trtglm.openai_api.errors import ApiError


def test_the_engine_gets_its_slots_and_a_quarter_more():
    assert [running_limit(slots) for slots in (1, 4, 8, 64, 256)] == [2, 5, 10, 80, 320]
    assert Admission(8, 128).waiting_limit == 128 and Admission(64, 128).waiting_limit == 512


def test_a_freed_place_goes_to_the_request_with_fewest_running():
    async def scenario() -> list[str]:
        admission = Admission(slots=1, largest_request=16)  # two places
        started: list[str] = []
        gates = {name: asyncio.Event() for name in ("big0", "big1", "big2", "big3", "small0")}

        async def sequence(ticket, name):
            async with ticket.place():
                started.append(name)
                await gates[name].wait()

        big = admission.admit(4)
        tasks = [asyncio.create_task(sequence(big, f"big{i}")) for i in range(4)]
        await asyncio.sleep(0)
        assert started == ["big0", "big1"] and (admission.running, admission.waiting) == (2, 2)
        small = admission.admit(1)
        tasks.append(asyncio.create_task(sequence(small, "small0")))
        await asyncio.sleep(0)
        gates["big0"].set()  # a place frees: the small request has none running, the big one has one
        await asyncio.sleep(0.01)
        assert started == ["big0", "big1", "small0"]
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks)
        admission.done(big), admission.done(small)
        assert (admission.running, admission.waiting, admission.tickets) == (0, 0, [])
        return started

    assert asyncio.run(scenario()) == ["big0", "big1", "small0", "big2", "big3"]


def test_a_request_beyond_the_waiting_bound_is_refused_whole_before_anything_runs():
    admission = Admission(slots=8, largest_request=128)  # 10 places, 128 may wait
    admission.admit(128)
    with pytest.raises(ApiError) as refused:
        admission.admit(20)
    assert refused.value.status == 429 and refused.value.headers()["Retry-After"] == "1"
    assert (admission.waiting, admission.refused) == (128, 1)
    with pytest.raises(ApiError) as too_big:
        Admission(slots=8, largest_request=128).admit(139)
    assert too_big.value.status == 400 and "at most 138" in str(too_big.value.body())


def test_cancelled_waiters_and_unstarted_sequences_stop_counting():
    async def scenario():
        admission = Admission(slots=1, largest_request=8)
        hold = asyncio.Event()

        async def sequence(ticket):
            async with ticket.place():
                await hold.wait()

        ticket = admission.admit(5)
        tasks = [asyncio.create_task(sequence(ticket)) for _ in range(4)]  # the fifth never asks
        await asyncio.sleep(0)
        assert (admission.running, admission.waiting) == (2, 3)
        for task in tasks[2:]:
            task.cancel()
        await asyncio.gather(*tasks[2:], return_exceptions=True)
        assert (admission.running, admission.waiting) == (2, 1)
        hold.set()
        await asyncio.gather(*tasks[:2])
        admission.done(ticket)
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())
