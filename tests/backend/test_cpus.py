"""The engines' own cores (trtglm.backend.cpus): the plan over a machine's topology as the kernel lists it, and an
engine's process really moving onto its rank's CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from support.topology import hyperthreaded, topology
from trtglm.backend import cpus


def test_the_kernels_cpu_lists_are_read():
    assert cpus.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_each_rank_gets_a_whole_physical_core_and_the_server_the_rest(tmp_path):
    sysfs = hyperthreaded(tmp_path, 8)  # 16 CPUs, as the single-GPU machines have
    engines, server = cpus.plan_engine_cpus(1, set(range(16)), sysfs)
    assert engines == [(7, 15)]
    assert server == set(range(16)) - {7, 15}
    engines, server = cpus.plan_engine_cpus(2, set(range(16)), sysfs)
    assert engines == [(6, 14), (7, 15)] and not server & {6, 14, 7, 15} and len(server) == 12


def test_only_allowed_cpus_are_planned(tmp_path):
    sysfs = hyperthreaded(tmp_path, 8)
    allowed = set(range(16)) - {7}  # a cpuset without one thread of the last core
    engines, server = cpus.plan_engine_cpus(1, allowed, sysfs)
    assert engines == [(15,)] and server == allowed - {15}


def test_small_machines_reserve_nothing(tmp_path):
    sysfs = hyperthreaded(tmp_path, 2)  # 4 CPUs
    assert cpus.plan_engine_cpus(1, set(range(4)), sysfs) == ([], set(range(4)))
    sysfs = topology(tmp_path / "big", {cpu: str(cpu) for cpu in range(8)})  # 8 cores, 8 engines: none left
    assert cpus.plan_engine_cpus(8, set(range(8)), sysfs) == ([], set(range(8)))


def test_unreadable_topology_counts_each_cpu_as_a_core(tmp_path):
    engines, server = cpus.plan_engine_cpus(1, set(range(8)), tmp_path / "missing")
    assert engines == [(7,)] and server == set(range(7))


def test_off_or_without_a_gpu_nothing_is_planned(monkeypatch, tmp_path):
    assert cpus.engine_cpus_env(1, {cpus.ENV: "off"}) == ({}, None)
    monkeypatch.setattr(cpus, "GPU_DEVICE", tmp_path)  # a device node that is there
    assert cpus.engine_cpus_env(1, {"CUDA_VISIBLE_DEVICES": ""}) == ({}, None)
    assert cpus.engine_cpus_env(1, {"CUDA_VISIBLE_DEVICES": "-1"}) == ({}, None)
    monkeypatch.setattr(cpus, "GPU_DEVICE", Path("/nonexistent/nvidiactl"))
    assert cpus.engine_cpus_env(1, {}) == ({}, None)


def test_a_gpu_machine_passes_each_ranks_core_to_the_engines(monkeypatch, tmp_path):
    monkeypatch.setattr(cpus, "GPU_DEVICE", tmp_path)
    monkeypatch.setattr(cpus, "SYSFS_CPUS", hyperthreaded(tmp_path / "sys", 8))
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    env, server = cpus.engine_cpus_env(2, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert env == {cpus.ENV: "6,14;7,15"} and server == set(range(16)) - {6, 7, 14, 15}


RANK_CPUS = """
import os, sys
from trtglm.backend.cpus import pin_engine
print(pin_engine(), sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("local_rank", [0, 1])
def test_an_engine_process_moves_onto_its_ranks_cpus(local_rank):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    value = f"{allowed[0]};{allowed[1]}"
    env = {**os.environ, cpus.ENV: value, "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", RANK_CPUS], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    mine = allowed[local_rank]
    assert done.stdout.split() == [f"({mine},)", f"[{mine}]"]


def test_a_bad_setting_leaves_the_engine_where_it_is():
    assert cpus.pin_engine({cpus.ENV: "0", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}) is None  # no entry for rank 3
    assert cpus.pin_engine({cpus.ENV: "off"}) is None
    assert cpus.pin_engine({}) is None
