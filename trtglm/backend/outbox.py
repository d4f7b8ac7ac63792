"""Responses sent off the executor's step thread by a few sender threads, merged while they pile up.

A python-backend `sender.send` is a round trip to the Triton process, and building a response
takes the GIL. Sent from the executor's step thread, or from one thread per request, 64 streams
take the GIL from the step so often that a 7 ms decode step became a 21 ms one on an H100
(docs/benchmarks.md). So the executor's callback only appends the output to its request's
`Mailbox`; SENDERS threads deliver the mailboxes in turn, each mailbox in order and on one
thread at a time, and the outputs that arrived while a request's previous response was in
flight go out together in its next one (their tokens in one response, as TensorRT-LLM's
streaming responses may carry several). The step competes with a few threads for the GIL, and
when sending falls behind, fewer, fuller responses absorb it.

A send can also wait forever (when whoever asked, a BLS model's stub say, has died). A sender
that has waited SLOW_SEND_S in one send is replaced (it ends once its send returns), so other
requests never wait behind it; a request whose send has waited SEND_TIMEOUT_S gets an error
at its next output, so the executor stops it and frees its slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from trtglm.errors import TrtglmError
from trtglm.runtime.executor import Output

log = logging.getLogger(__name__)

SENDERS = 2  # sender threads not stuck in a send
SLOW_SEND_S = 0.25  # a sender waiting this long in one send is replaced (a send takes well under a millisecond)
SEND_TIMEOUT_S = 5.0  # a response Triton has not taken by then never will be: whoever asked is gone


def merge(outputs: list[Output]) -> Output:
    """Consecutive outputs of one request as one: their tokens in order, the last one's end."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return Output(tokens=[t for o in outputs for t in o.tokens], log_probs=[p for o in outputs for p in o.log_probs],
                  finished=last.finished, reason=last.reason,
                  error=next((o.error for o in outputs if o.error), None),
                  scheduled_ns=next((o.scheduled_ns for o in outputs if o.scheduled_ns is not None), None),
                  kv_blocks=next((o.kv_blocks for o in reversed(outputs) if o.kv_blocks is not None), None),
                  context_logits=next((o.context_logits for o in outputs if o.context_logits is not None), None),
                  generation_logits=_joined_rows([o.generation_logits for o in outputs]))


def _joined_rows(parts: list) -> np.ndarray | None:
    """Several outputs' generation logits rows as one array (None when none has any)."""
    given = [part for part in parts if part is not None]
    return np.concatenate(given) if given else None


class Outbox:
    """The sender threads of one model and the queue of mailboxes with something to send."""

    def __init__(self, senders: int = SENDERS, send_timeout_s: float = SEND_TIMEOUT_S, slow_send_s: float = SLOW_SEND_S):
        self.senders, self.send_timeout_s, self.slow_send_s = senders, send_timeout_s, slow_send_s
        self._ready: queue.SimpleQueue[Mailbox | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    def mailbox(self, deliver: Callable[[Output], None]) -> Mailbox:
        """A request's mailbox: `deliver(output)` is called on a sender thread with what piled up, merged."""
        return Mailbox(self, deliver)

    def stop(self, timeout: float = 2.0) -> None:
        """Let the queued responses out (for at most `timeout` s), then end the sender threads."""
        with self._lock:
            self._stopped.set()
            threads = list(self._threads)
        for _ in threads:
            self._ready.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def schedule(self, box: Mailbox) -> None:
        self._ready.put(box)
        self._replace_stuck_senders()

    def _watch(self) -> None:
        """Replace stuck senders even while no new output comes (the queued mailboxes wait on them)."""
        while not self._stopped.wait(self.slow_send_s / 2):
            self._replace_stuck_senders()

    def _replace_stuck_senders(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="trtglm-sender-watch", daemon=True)
                self._watchdog.start()
            now = time.monotonic()
            for thread in self._threads:
                since = getattr(thread, "sending_since", None)
                if since is not None and now - since > self.slow_send_s:
                    thread.stuck = True  # type: ignore[attr-defined]
            self._threads = [t for t in self._threads if t.is_alive() and not getattr(t, "stuck", False)]
            while len(self._threads) < self.senders:
                thread = threading.Thread(target=self._run, name="trtglm-sender", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while (box := self._ready.get()) is not None:
            if box.send_next(me) == "stuck":
                return  # this thread is written off; a new one took its place


class Mailbox:
    """One request's outputs between the executor's thread (`__call__`) and the sender threads."""

    def __init__(self, outbox: Outbox, deliver: Callable[[Output], None]):
        self._outbox, self._deliver = outbox, deliver
        self._lock = threading.Lock()
        self._pending: list[Output] = []
        self._scheduled = False  # queued for, or being sent by, a sender thread
        self._sending_since: float | None = None  # when the send in flight began
        self.error: str | None = None  # set once a delivery failed or stalled: the client is gone

    def __call__(self, output: Output) -> None:
        with self._lock:
            self._check_stalled()
            if self.error is not None:
                raise TrtglmError(self.error)
            self._pending.append(output)
            if self._scheduled:
                return
            self._scheduled = True
        self._outbox.schedule(self)

    def send_next(self, thread: threading.Thread) -> str:
        """Deliver what piled up (one response); queue the mailbox again if more came meanwhile."""
        with self._lock:
            outputs, self._pending = self._pending, []
            if not outputs or self.error is not None:
                self._scheduled = False
                return "idle"
            self._sending_since = time.monotonic()
        thread.sending_since = self._sending_since  # type: ignore[attr-defined]
        try:
            self._deliver(merge(outputs))
        except Exception as e:
            thread.sending_since = None  # type: ignore[attr-defined]
            log.debug("a response could not be sent: %s", e)
            with self._lock:
                self.error, self._pending, self._scheduled, self._sending_since = \
                    f"a response could not be sent: {e}", [], False, None
            return "failed"
        thread.sending_since = None  # type: ignore[attr-defined]
        with self._lock:
            self._sending_since = None
            more = bool(self._pending)
            self._scheduled = more
        if more:
            self._outbox.schedule(self)
        return "stuck" if getattr(thread, "stuck", False) else "sent"  # a replaced sender ends here

    def _check_stalled(self) -> None:  # called with the lock held
        if self.error is not None or self._sending_since is None:
            return
        if time.monotonic() - self._sending_since > self._outbox.send_timeout_s:
            self.error = f"a response has waited {self._outbox.send_timeout_s:g} s to be sent: whoever asked is gone"
