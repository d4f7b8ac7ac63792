"""Which of the API's sequences run now (one sequence: one choice of one prompt).

The engine runs `slots` sequences at once and queues the rest first come, first served; one request of 16 prompts
× n 8 would fill that queue and make every later client wait behind all of it (or be refused as busy while its
own first sequences already run). So the API keeps the engine's part small and orders the rest itself:

- at most RUNNING_LIMIT = slots + slots/4 of its sequences are in the engine at once (the extra quarter keeps a
  freed slot from idling while the next sequence travels to it);
- a freed place goes to the request with the fewest sequences running, the oldest among equals: a small request
  beside a large one starts at the next place that frees, not after the large one;
- at most `waiting_limit` sequences wait (default: the larger of the engine's queue bound, 8 a slot, and the
  largest request the API takes, MAX_PROMPTS × n); a request that would wait beyond it is refused whole, 429 with
  Retry-After, before any of its sequences runs, and one larger than the API ever takes is a 400.

The counts are exported as Prometheus gauges on the API's /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from trtglm.openai_api.errors import ApiError

QUEUE_PER_SLOT = 8  # as the engine's default queue bound (backend/engine.py)
RETRY_AFTER_S = 1


def running_limit(slots: int) -> int:
    return slots + max(1, slots // 4)


@dataclass
class Ticket:
    """One admitted request: its sequences, how many asked for a place so far, how many run now."""

    admission: Admission
    sequences: int
    arrival: int
    asked: int = 0
    running: int = 0
    waiters: deque = field(default_factory=deque)

    @asynccontextmanager
    async def place(self):
        """Wait for this request's turn, run one sequence inside the block, give the place back after it."""
        self.asked += 1
        granted = asyncio.get_running_loop().create_future()
        self.waiters.append(granted)
        self.admission.grant()
        try:
            await granted
        except asyncio.CancelledError:
            if granted in self.waiters:  # still waiting: it leaves the line (whoever takes it out counts it)
                self.waiters.remove(granted)
                self.admission.waiting -= 1
            elif granted.done() and not granted.cancelled():  # granted just before the cancel
                self.admission.release(self)
            raise
        try:
            yield
        finally:
            self.admission.release(self)


class Admission:
    def __init__(self, slots: int, largest_request: int, waiting_limit: int | None = None):
        self.running_limit = running_limit(slots)
        self.waiting_limit = waiting_limit or max(QUEUE_PER_SLOT * slots, largest_request)
        self.largest_request = largest_request
        self.running = self.waiting = 0
        self.refused = 0
        self.tickets: list[Ticket] = []
        self._arrivals = itertools.count()

    def admit(self, sequences: int) -> Ticket:
        """A ticket for a request of `sequences`; 429 (nothing of it runs) when they would wait beyond the bound."""
        if sequences > self.running_limit + self.waiting_limit:
            raise ApiError(400, f"the request asks for {sequences} sequences (prompts × n); this server takes at "
                                f"most {self.running_limit + self.waiting_limit}", "n", "invalid_value")
        free = max(0, self.running_limit - self.running - self.waiting)
        if self.waiting + max(0, sequences - free) > self.waiting_limit:
            self.refused += 1
            raise ApiError(429, f"the server is busy: {self.waiting} sequences already wait (at most "
                                f"{self.waiting_limit}); retry later", kind="server_error", code="server_busy",
                           retry_after=RETRY_AFTER_S)
        self.waiting += sequences
        ticket = Ticket(self, sequences, next(self._arrivals))
        self.tickets.append(ticket)
        return ticket

    def done(self, ticket: Ticket) -> None:
        """The request ended: sequences of it that never asked for a place (it failed or was cancelled first) stop
        counting as waiting."""
        self.waiting -= ticket.sequences - ticket.asked
        ticket.asked = ticket.sequences
        if ticket in self.tickets:
            self.tickets.remove(ticket)
        self.grant()

    def grant(self) -> None:
        """Hand free places to waiting sequences, fewest running first."""
        while self.running < self.running_limit:
            candidates = [t for t in self.tickets if t.waiters]
            if not candidates:
                return
            ticket = min(candidates, key=lambda t: (t.running, t.arrival))
            granted = ticket.waiters.popleft()
            self.waiting -= 1
            if granted.cancelled():  # its sequence was cancelled while it waited
                continue
            ticket.running += 1
            self.running += 1
            granted.set_result(None)

    def release(self, ticket: Ticket) -> None:
        ticket.running -= 1
        self.running -= 1
        self.grant()
