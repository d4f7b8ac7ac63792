"""CPU cores of their own for the engines' step loops.

A GPU engine's decode step is GPU work framed by Python: inputs prepared, graphs launched, tokens
read back and handed on. Served, the same machine also runs tritonserver's frontends, the python
stubs that send every streamed token and often the load's clients; their threads land on the core
(or on the hyperthread sibling) of the step loop and stretch every step (docs/benchmarks.md,
"Served on GPU"). So on a machine with GPUs and enough CPUs, `launch` gives each local rank's
engine one physical core (every hardware thread of it) and runs tritonserver, its stubs and the
OpenAI API on the others:

- the supervisor starts the server with the other CPUs as its affinity and tells the engines their
  cores in TRTGLM_ENGINE_CPUS (`0,32;1,33`: local rank 0's CPUs, then rank 1's…);
- the engine's process (started by the tensorrt_llm stub) moves itself onto its rank's CPUs before it
  starts any thread (`pin_engine`).

TRTGLM_ENGINE_CPUS=off, or fewer than MIN_CPUS CPUs, or no GPU (none there, or CUDA_VISIBLE_DEVICES empty),
leaves every process on every CPU; an engine that runs on the CPU stays on every CPU too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "TRTGLM_ENGINE_CPUS"
MIN_CPUS = 8  # below this, a reserved core costs the server more than it gives the step loop
SYSFS_CPUS = Path("/sys/devices/system/cpu")
GPU_DEVICE = Path("/dev/nvidiactl")


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` (the kernel's list format) as CPU numbers."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(allowed: set[int], sysfs: Path = SYSFS_CPUS) -> list[tuple[int, ...]]:
    """The allowed CPUs grouped by physical core (hardware threads of one core together), in CPU order; a CPU
    whose topology cannot be read is a core of its own."""
    cores: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        try:
            siblings = parse_cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = [cpu]
        cores[tuple(c for c in siblings if c in allowed) or (cpu,)] = None
    return list(cores)


def plan_engine_cpus(local_ranks: int, allowed: set[int],
                     sysfs: Path = SYSFS_CPUS) -> tuple[list[tuple[int, ...]], set[int]]:
    """(each local rank's engine CPUs, the server's CPUs), or ([], allowed) when there are too few to spare: the
    last physical cores go to the engines, so that what the server runs keeps CPU 0 onwards."""
    cores = physical_cores(allowed, sysfs)
    if len(allowed) < MIN_CPUS or len(cores) < 2 * local_ranks:
        return [], set(allowed)
    engines = cores[-local_ranks:]
    return engines, set(allowed) - {cpu for core in engines for cpu in core}


def engine_cpus_env(local_ranks: int, environ: dict[str, str]) -> tuple[dict[str, str], set[int] | None]:
    """(variables to add to the server's environment, the server's CPUs or None to leave them be)."""
    if environ.get(ENV, "").lower() == "off" or not gpus_visible(environ):
        return {}, None
    engines, server = plan_engine_cpus(local_ranks, set(os.sched_getaffinity(0)), SYSFS_CPUS)
    if not engines:
        return {}, None
    value = ";".join(",".join(map(str, core)) for core in engines)
    log.info("engines on CPUs %s (one core a rank); the server on the other %d", value, len(server))
    return {ENV: value}, server


def gpus_visible(environ: dict[str, str]) -> bool:
    """Whether the ranks will see a GPU: the driver's device is there and CUDA_VISIBLE_DEVICES hides none of it."""
    hidden = environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return GPU_DEVICE.exists() and not hidden


def pin_engine(environ: dict[str, str] | None = None) -> tuple[int, ...] | None:
    """Move this process (its calling thread, and every thread it starts after) onto its local rank's CPUs from
    TRTGLM_ENGINE_CPUS; the CPUs, or None where there is nothing to do or the move is refused."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "")
    if not value or value.lower() == "off":
        return None
    local_rank = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", environ.get("LOCAL_RANK", "0")))
    try:
        cpus = tuple(parse_cpu_list(value.split(";")[local_rank]))
        os.sched_setaffinity(0, cpus)
    except (IndexError, ValueError, OSError) as e:
        log.warning("could not move the engine onto its CPUs (%s=%s, local rank %d): %s", ENV, value, local_rank, e)
        return None
    log.info("the engine runs on CPUs %s", ",".join(map(str, cpus)))
    return cpus
