"""Waking the supervisor the moment a watched process exits (Linux pidfds), instead of at its next poll.

A pidfd (pidfd_open(2), Linux 5.3+) becomes readable when its process exits, whether or not anyone has
reaped it yet, and works for any process, not only children: a rank's python stubs and engine processes
are Triton's children. The supervisor waits on every watched process's pidfd with its poll period as the
timeout, so a death is acted on after the kernel's wake-up, not after up to a period, and a sleeping
supervisor is scheduled ahead of busy processes on a loaded machine. Where pidfds are missing (an older
kernel), `wait` is a plain sleep and the poll finds the death.
"""

from __future__ import annotations

import os
import select
import time


class ExitWaiter:
    """pidfds of the watched processes; `wait` returns the pids that exited (each reported once)."""

    def __init__(self):
        self.pidfds: dict[int, int] = {}  # fd → pid
        self.watched: set[int] = set()
        self.poller = select.poll()
        self.available = hasattr(os, "pidfd_open")

    def watch(self, pids) -> None:
        for pid in pids:
            if pid in self.watched or not self.available:
                continue
            self.watched.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # already gone: the poll's own listing finds that
            except OSError:
                self.available = False  # no pidfds here (ENOSYS): poll at the period only
                continue
            self.pidfds[fd] = pid
            self.poller.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> set[int]:
        """Sleep up to timeout_s, less if a watched process exits: the pids that did."""
        if not self.pidfds:
            time.sleep(timeout_s)
            return set()
        exited = set()
        for fd, _ in self.poller.poll(timeout_s * 1000):
            exited.add(self.pidfds.pop(fd))
            self.poller.unregister(fd)
            os.close(fd)
        return exited

    def close(self) -> None:
        for fd in self.pidfds:
            os.close(fd)
        self.pidfds.clear()
        self.watched.clear()
