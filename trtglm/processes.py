"""Whether a process still runs: for the supervisor watching its ranks and the served models watching their
sibling stubs; and stopping a child process."""

from __future__ import annotations

import subprocess

import psutil


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a dead child stays one until its parent reaps it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_child(popen: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM a child that still runs, wait up to `grace_s`, then SIGKILL it; reaped either way."""
    if popen is None or popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
