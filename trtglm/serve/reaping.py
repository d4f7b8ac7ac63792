"""The supervisor as its launch's subreaper: processes orphaned below it become its children, and it reaps
those that end, so that no zombie is left (supervise.py)."""

from __future__ import annotations

import logging
import os

from trtglm.serve.stubs import child_pids

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


def become_subreaper() -> None:
    """Make processes orphaned below this one its children (Linux), so that reap_orphans can wait for them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("no subreaper: orphans of the launch go to init")


def reap_orphans(own: set[int]) -> None:
    """Wait for this process's children that have ended, but for those in `own` (Popen waits for them)."""
    for pid in child_pids(os.getpid()):
        if pid not in own:
            try:
                os.waitpid(pid, os.WNOHANG)  # returns at once for a child still running
            except ChildProcessError:
                continue
