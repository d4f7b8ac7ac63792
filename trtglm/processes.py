"""Whether a process still runs: for the supervisor watching its ranks and the served models watching their
sibling stubs."""

from __future__ import annotations

import psutil


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a dead child stays one until its parent reaps it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
