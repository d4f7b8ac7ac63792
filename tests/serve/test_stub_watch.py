"""StubWatch tells a python-backend stub that died from one that Triton replaced: real child processes
with a stub's argv (Triton's order: model.py, shm region, sizes, parent pid, lib dir, ipc handle, instance
name, model dir) stand for the stubs of a tritonserver, this test process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from trtglm.serve.stubs import StubWatch, stub_instances
from trtglm.serve.tritonserver import STUB


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
        while proc.pid not in stub_instances(me()) and time.monotonic() < deadline:
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


def test_stub_instances_reads_model_and_instance(spawn):
    proc = spawn("postprocessing", "postprocessing_0_1")
    assert stub_instances(me())[proc.pid] == ("postprocessing", "postprocessing_0_1")


def test_a_killed_stub_is_a_death(spawn):
    watch = StubWatch()
    doomed = spawn("postprocessing", "postprocessing_0_0")
    spawn("postprocessing", "postprocessing_0_1")
    spawn("preprocessing", "preprocessing_0_0")
    assert watch.died(me()) == set()
    end(doomed)
    assert watch.died(me()) == {"postprocessing"}  # one instance of two is enough
    assert watch.died(me()) == set()


def test_a_replaced_stub_is_no_death(spawn):
    """Triton reloading a model (its `load`, or an ensemble's load reloading its parts) starts the new
    instance's stub before the old one exits."""
    watch = StubWatch()
    old = spawn("tensorrt_llm", "tensorrt_llm_0_0")
    assert watch.died(me()) == set()
    spawn("tensorrt_llm", "tensorrt_llm_0_0")
    end(old)
    assert watch.died(me()) == set()
    old_seen_with_new = spawn("tensorrt_llm", "tensorrt_llm_0_0")
    assert watch.died(me()) == set()
    end(old_seen_with_new)
    assert watch.died(me()) == set()


def test_other_children_are_no_stubs(spawn, tmp_path):
    script = tmp_path / "other.py"
    script.write_text("import time\ntime.sleep(120)\n")
    other = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.2)
        assert other.pid not in stub_instances(me())
    finally:
        end(other)

