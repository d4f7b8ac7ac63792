"""The outbox: responses delivered off the producing thread, in order, merged while one is in flight."""

from __future__ import annotations

import threading
import time

import pytest

from trtglm.backend.llm_responses import Timing
from trtglm.backend.outbox import Outbox, merge
from trtglm.errors import TrtglmError
from trtglm.runtime.request import KvBlocks, Output


@pytest.fixture
def outbox():
    box = Outbox(senders=2, send_timeout_s=0.3)
    yield box
    box.stop()


def wait_for(condition, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_merge_keeps_order_and_takes_the_last_end():
    outputs = [Output([1], [-0.5]), Output([2, 3], [-0.25, -0.125]), Output([], [], True, "end_id")]
    assert merge(outputs) == Output([1, 2, 3], [-0.5, -0.25, -0.125], True, "end_id", None)
    assert merge([Output([4], [], True, "error", "boom")]).error == "boom"
    # when the request got its slot (its first output says) survives the merge: the perf metrics report it
    assert merge([Output([1], scheduled_ns=123), Output([2])]).scheduled_ns == 123
    # and so do the KV-cache blocks the sequence takes, the latest
    merged = merge([Output([1], kv_blocks=KvBlocks(2, 1)), Output([2], kv_blocks=KvBlocks(3, 1)),
                    Output([], finished=True)])
    assert merged.kv_blocks == KvBlocks(3, 1)


def test_the_perf_metrics_count_the_blocks_the_latest_output_says():
    timing = Timing(arrival_ns=5)
    assert [timing.arrays()[name].item() for name in Timing.OUTPUTS[:3]] == [0, 0, 0]  # never placed
    timing.update(Output([7], kv_blocks=KvBlocks(total=4, reused=3)))
    timing.update(Output([8]))
    assert [timing.arrays()[name].item() for name in Timing.OUTPUTS[:3]] == [1, 3, 4]  # new, reused, total


def test_outputs_arriving_during_a_send_go_out_together_in_order(outbox):
    sending, release, delivered = threading.Event(), threading.Event(), []

    def deliver(output: Output) -> None:
        if not delivered:
            sending.set()
            release.wait(5)  # the first response is slow to send
        delivered.append(output)

    box = outbox.mailbox(deliver)
    box(Output([1]))
    assert sending.wait(5)
    for token in range(2, 6):
        box(Output([token]))
    box(Output([6], finished=True, reason="length"))
    release.set()
    wait_for(lambda: len(delivered) == 2)
    assert delivered == [Output([1]), Output([2, 3, 4, 5, 6], [], True, "length", None)]


def test_many_requests_each_get_all_their_tokens_in_order(outbox):
    received: dict[int, list[int]] = {}
    busy: set[int] = set()

    def deliverer(request: int):
        def deliver(output: Output) -> None:
            assert request not in busy, "two sender threads delivered one request's outputs at once"
            busy.add(request)
            received.setdefault(request, []).extend(output.tokens)
            time.sleep(0.001)
            busy.discard(request)
        return deliver

    boxes = [outbox.mailbox(deliverer(r)) for r in range(16)]
    for step in range(50):
        for box in boxes:
            box(Output([step]))
    wait_for(lambda: all(len(received.get(r, [])) == 50 for r in range(16)))
    assert all(received[r] == list(range(50)) for r in range(16))


def test_a_failed_delivery_stops_that_request_alone(outbox):
    calls, other = [], []

    def deliver(output: Output) -> None:
        calls.append(output)
        raise RuntimeError("the client is gone")

    box, fine = outbox.mailbox(deliver), outbox.mailbox(other.append)
    box(Output([1]))
    wait_for(lambda: box.error is not None)
    with pytest.raises(TrtglmError, match="could not be sent: the client is gone"):
        box(Output([2]))
    fine(Output([7], finished=True))
    wait_for(lambda: other == [Output([7], finished=True)])
    assert calls == [Output([1])]


def test_a_send_that_never_returns_stops_its_request_and_its_sender_is_replaced(outbox):
    never, delivered = threading.Event(), []
    stuck = [outbox.mailbox(lambda output: never.wait()) for _ in range(2)]  # as many as there are senders
    for box in stuck:
        box(Output([1]))
    time.sleep(0.4)
    for box in stuck:
        with pytest.raises(TrtglmError, match="waited 0.3 s to be sent"):
            box(Output([2]))
    fine = outbox.mailbox(delivered.append)
    fine(Output([3], finished=True))
    wait_for(lambda: delivered == [Output([3], finished=True)])
    never.set()
