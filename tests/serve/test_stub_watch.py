"""DeathWatch tells a python-backend stub that died (nobody reaps it) from one that Triton stopped or
replaced (reaped at once): real child processes with a stub's argv (Triton's order: model.py, shm region, sizes, parent pid, lib dir, ipc handle, instance
name, model dir) stand for the stubs of a tritonserver, this test process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from trtglm.backend.contract import STUB
from trtglm.serve import stubs
from trtglm.serve.stubs import ZOMBIE_S, DeathWatch, child_pids, describe, descendants


@pytest.fixture
def spawn(tmp_path):
    started: list[subprocess.Popen] = []

    def start(model: str, instance: str) -> subprocess.Popen:
        script = tmp_path / "repo" / model / "1" / "model.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("import time\ntime.sleep(120)\n")
        argv = [f"/opt/backends/python/{STUB}", str(script), "prefix_rank0_x", "1048576", "1048576",
                str(os.getpid()), "/opt/backends/python", "336", instance, "DEFAULT"]
        proc = subprocess.Popen(argv, executable=sys.executable)
        started.append(proc)
        deadline = time.monotonic() + 10  # until its argv is the stub's
        while "python stub" not in describe(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def me() -> psutil.Process:
    return psutil.Process(os.getpid())


def end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_stub_is_named_by_its_model_and_instance(spawn):
    proc = spawn("postprocessing", "postprocessing_0_1")
    assert describe(proc.pid) == "postprocessing's python stub (postprocessing_0_1)"
    assert proc.pid in descendants(os.getpid())


@pytest.fixture
def watching():
    """A started DeathWatch of this process's children, stopped after the test."""
    started: list[DeathWatch] = []

    def start() -> DeathWatch:
        started.append(DeathWatch({0: me()}).start())
        return started[-1]

    yield start
    for watch in started:
        watch.stop()


def dead_after(watch: DeathWatch, limit_s: float = 5.0) -> tuple[int, str] | None:
    """What `watch` calls dead, asked at each wake (an exit, or 0.05 s) for up to `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = watch.died()
        if found:
            return found
        watch.wait(0.05)
    return None


def test_a_killed_stub_that_nobody_reaps_is_a_death(spawn, watching):
    """Triton 2.51 never waits for a stub that died: it stays a zombie."""
    doomed = spawn("postprocessing", "postprocessing_0_1")
    spawn("preprocessing", "preprocessing_0_0")
    watch = watching()
    assert watch.died() is None
    doomed.kill()  # not waited for
    killed = time.monotonic()
    assert dead_after(watch) == (0, f"rank 0's postprocessing's python stub (postprocessing_0_1) (pid {doomed.pid})")
    assert time.monotonic() - killed >= ZOMBIE_S


def test_a_known_stubs_death_is_seen_from_its_exit_without_listing_the_tree(spawn, watching):
    """The wake-up after an exit looks only at the processes that exited: no listing of the (large) tree."""
    doomed = spawn("tensorrt_llm", "tensorrt_llm_0_0")
    watch = watching()
    watch.stop()  # no more listings
    watch.scan = None  # and none by the watching thread either
    watch.wait(0.01)  # its pidfd is watched from here on
    doomed.kill()
    assert dead_after(watch) == (0, f"rank 0's tensorrt_llm's python stub (tensorrt_llm_0_0) (pid {doomed.pid})")


def test_a_stub_started_after_the_watch_is_known_from_the_next_listing(spawn, watching):
    watch = watching()
    late = spawn("postprocessing", "postprocessing_0_0")
    deadline = time.monotonic() + 10 * stubs.SCAN_S
    while late.pid not in watch.roles and time.monotonic() < deadline:
        time.sleep(0.05)
    late.kill()
    assert dead_after(watch) == (0, f"rank 0's postprocessing's python stub (postprocessing_0_0) (pid {late.pid})")


def test_a_stub_reaped_at_once_is_no_death(spawn, watching):
    """A stub that Triton stops (an unload, a reload that replaces it) is reaped at once."""
    spawn("tensorrt_llm", "tensorrt_llm_0_0")
    old = spawn("tensorrt_llm", "tensorrt_llm_0_0")
    watch = watching()
    assert watch.died() is None
    end(old)
    assert dead_after(watch, 3 * ZOMBIE_S) is None


def test_a_zombie_seen_for_less_than_the_bound_is_no_death(spawn, watching):
    stub = spawn("preprocessing", "preprocessing_0_0")
    watch = watching()
    assert watch.died() is None
    stub.kill()
    while psutil.Process(stub.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    watch.scan()
    assert watch.died() is None  # first seen dead now
    stub.wait()
    assert dead_after(watch, 3 * ZOMBIE_S) is None


def test_other_children_are_no_stubs(spawn, tmp_path):
    script = tmp_path / "other.py"
    script.write_text("import time\ntime.sleep(120)\n")
    other = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.2)
        assert describe(other.pid) == repr(psutil.Process(other.pid).name())
    finally:
        end(other)


def test_a_process_gone_while_its_children_are_read_has_none(monkeypatch):
    """The supervisor reads children lists every poll; a process that exits before or while its task folder is
    read has no children (it once stopped a launch with FileNotFoundError)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert child_pids(gone.pid) == [] and descendants(gone.pid) == []

    def vanished(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(stubs.os, "listdir", vanished)
    assert child_pids(os.getpid()) == []
