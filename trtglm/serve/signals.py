"""The stop signals a supervising process's main loop reads: the first asks for an orderly stop, a second for
haste (no grace periods)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalFlags:
    def __init__(self):
        self.stop: int | None = None  # the first stop signal received
        self.hurry = False  # a second came
        self._on_hurry: Callable[[], None] | None = None

    def install(self, on_hurry: Callable[[], None] | None = None) -> dict:
        """Catch the stop signals (main thread only); the handlers they replace, for `restore`."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        self._on_hurry = on_hurry
        return {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}

    @staticmethod
    def restore(previous: dict) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame) -> None:
        if self.stop is None:
            self.stop = signum
            return
        self.hurry = True
        if self._on_hurry is not None:
            self._on_hurry()
