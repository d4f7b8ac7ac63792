"""Whether a process still runs: for the supervisor watching its ranks and the served models watching their
sibling stubs; stopping a child process; the signal that tells the OpenAI API its launch stops."""

from __future__ import annotations

import signal
import subprocess

import psutil

NOT_READY_SIGNAL = signal.SIGUSR1  # to the OpenAI API: its launch stops, so /health answers 503 from now on


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
