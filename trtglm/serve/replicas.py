"""Where each replica of `launch --replicas N` runs: its GPUs, its ports, its CPUs. Pure functions of their
inputs (the visible GPUs, the flags, the CPU topology), so that every replica's command line and environment can
be checked without starting anything.

- GPUs: replica i gets GPUs i·W … i·W+W−1 of those visible (world size W), or of `--gpus` in the order given, as
  its CUDA_VISIBLE_DEVICES. Visible means CUDA_VISIBLE_DEVICES's entries where it is set, else the GPUs
  `nvidia-smi -L` lists; a machine with neither (a CPU machine) gives its replicas no GPUs.
- Ports: replica i serves on the block BASE+4i … BASE+4i+3 (HTTP, gRPC, metrics, OpenAI), BASE defaulting to the
  front's HTTP port + 100. HTTP, gRPC and OpenAI bind loopback, reached through the front only; metrics bind where
  the front does, for Prometheus to scrape each replica.
- CPUs: on a GPU machine the allowed physical cores are split into N contiguous shares, so that each replica's
  engines get cores of their own (backend/cpus.py plans within a share) and no two replicas pin the same core.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trtglm.backend.cpus import SYSFS_CPUS, physical_cores, plan_engine_cpus
from trtglm.errors import UsageError
from trtglm.serve.command import Endpoints

PORTS_PER_REPLICA = 4  # HTTP, gRPC, metrics, OpenAI
REPLICA_PORT_OFFSET = 100  # the replicas' block starts this far above the front's HTTP port
PRIVATE_HOST = "127.0.0.1"  # a replica's client ports: only the front reaches them


@dataclass(frozen=True)
class ReplicaPlace:
    """One replica's share of the machine."""

    index: int
    gpus: tuple[str, ...] | None  # its CUDA_VISIBLE_DEVICES entries; None: no GPUs to assign (a CPU machine)
    endpoints: Endpoints
    cpus: tuple[int, ...] | None  # None: every CPU

    def environment(self) -> dict[str, str]:
        return {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)}


def visible_gpus(environ: dict[str, str]) -> list[str] | None:
    """The GPUs this machine lets a launch use, as CUDA_VISIBLE_DEVICES entries; None on a machine without a GPU
    driver where CUDA_VISIBLE_DEVICES is not set."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        value = environ["CUDA_VISIBLE_DEVICES"].strip()
        return [] if value in ("", "-1") else [entry.strip() for entry in value.split(",")]
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return None
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def gpu_groups(replicas: int, world_size: int, visible: list[str] | None, chosen: list[str] | None) \
        -> list[tuple[str, ...] | None]:
    """Each replica's GPUs: consecutive groups of `world_size` from `chosen` (`--gpus`) or else `visible`."""
    wanted = replicas * world_size
    if chosen is not None:
        if len(chosen) != wanted or len(set(chosen)) != len(chosen):
            raise UsageError(f"--gpus must name {wanted} different GPUs ({replicas} replica(s) × world size "
                             f"{world_size}), not {','.join(chosen)}")
        unknown = [gpu for gpu in chosen if visible is not None and gpu not in visible]
        if unknown:
            raise UsageError(f"--gpus {','.join(unknown)}: not among the visible GPUs ({','.join(visible) or 'none'})")
        pool = chosen
    elif visible is None:
        return [None] * replicas
    else:
        if wanted > len(visible):
            raise UsageError(f"{replicas} replica(s) × world size {world_size} need {wanted} GPUs, but "
                             f"{len(visible)} are visible ({','.join(visible) or 'none'})")
        pool = visible
    return [tuple(pool[i * world_size:(i + 1) * world_size]) for i in range(replicas)]


def replica_endpoints(index: int, base: int, front: Endpoints) -> Endpoints:
    """Replica `index`'s ports: the block at `base` + 4·index, HTTP, gRPC and OpenAI on loopback."""
    first = base + PORTS_PER_REPLICA * index
    if first + PORTS_PER_REPLICA - 1 > 65535:
        raise UsageError(f"--replica-ports {base}: replica {index}'s ports would pass 65535")
    return Endpoints(PRIVATE_HOST, first, first + 1, first + 2,
                     first + 3 if front.openai_port is not None else None, metrics_host=front.host)


def cpu_shares(replicas: int, allowed: set[int], sysfs: Path = SYSFS_CPUS) -> list[tuple[int, ...] | None]:
    """The allowed CPUs in `replicas` contiguous shares of whole physical cores; every CPU for each when there
    are fewer cores than replicas."""
    cores = physical_cores(allowed, sysfs)
    if replicas == 1 or len(cores) < replicas:
        return [None] * replicas
    size, extra = divmod(len(cores), replicas)
    shares, start = [], 0
    for i in range(replicas):
        end = start + size + (i < extra)
        shares.append(tuple(sorted(cpu for core in cores[start:end] for cpu in core)))
        start = end
    return shares


def place_replicas(replicas: int, world_size: int, front: Endpoints, base: int | None, chosen_gpus: list[str] | None,
                   environ: dict[str, str], assign_gpus: bool = True) -> list[ReplicaPlace]:
    """Every replica's GPUs, ports and CPUs (the CPUs split only where the replicas get GPUs). Without
    `assign_gpus` (a replica whose ranks span hosts: hosts.py) no replica is given GPUs: each host's ranks take
    that host's in order."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise UsageError(f"--replicas must be a whole number ≥ 1, not {replicas!r}")
    groups = (gpu_groups(replicas, world_size, visible_gpus(environ), chosen_gpus) if assign_gpus
              else [None] * replicas)
    base = front.http_port + REPLICA_PORT_OFFSET if base is None else base
    on_gpus = groups[0] is not None and environ.get("TRTGLM_ENGINE_CPUS", "").lower() != "off"
    shares = cpu_shares(replicas, set(os.sched_getaffinity(0))) if on_gpus else [None] * replicas
    return [ReplicaPlace(i, groups[i], replica_endpoints(i, base, front), shares[i]) for i in range(replicas)]


def front_cpus(places: list[ReplicaPlace], world_size: int) -> tuple[int, ...] | None:
    """The CPUs the front may use: every one of the replicas' shares but the cores their engines take
    (backend/cpus.py's plan within each share); None where the replicas keep every CPU."""
    if any(place.cpus is None for place in places):
        return None
    free = set()
    for place in places:
        engines, server = plan_engine_cpus(world_size, set(place.cpus))
        free |= server
    return tuple(sorted(free)) or None
