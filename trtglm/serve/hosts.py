"""Ranks on several hosts: `trtglm launch --world-size N --hostfile F` (or `--hosts a,b`).

One rank per host slot, in order: the first host's slots take ranks 0, 1, …, then the next host's (mpirun's
`--host` list, mapped by slot). The first host is this machine: rank 0 serves the endpoints there and the
supervisor watches it there. What differs from ranks on one host (command.py):

- mpirun reaches the other hosts with its remote shell (ssh, or `--rsh-agent CMD`, Open MPI's plm_rsh_agent), and
  the ranks talk over the hosts' networks: no loopback-only MCA settings, no listeners held to loopback, no
  GLOO/NCCL_SOCKET_IFNAME=lo. The ranks meet at the first host (MASTER_ADDR, and a MASTER_PORT free there), rank
  0's steps reach the others over TCP (runtime/step_link.py), and NCCL makes every all-reduce (the one-shot kernel
  needs every rank's GPU on one host);
- before anything starts, mpirun runs a check on every host (`check_hosts`): the repository, the engine and the
  rank files of that host's ranks must be there under the same paths as here, else the launch stops and names the
  host and what it lacks. A host that mpirun cannot reach yet (a pod still starting) is asked again until the
  launch's timeout;
- each rank runs under a rank agent on its host (rank_agent.py): its tritonserver's logs and its state lie in the
  launch's log folder on that host, and its stubs and engine process are watched there as the supervisor watches
  them on one host. A death ends the rank and mpirun ends the job, which the supervisor sees; an orderly stop
  reaches every agent as SIGUSR1, which mpirun passes on to the ranks on every host.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from trtglm.backend.contract import TENSORRT_LLM
from trtglm.engine.manifest import MANIFEST, read_manifest
from trtglm.errors import ModelFileError, UsageError
from trtglm.model_repository import CONFIG, engine_description, engine_dir
from trtglm.serve.command import MPIRUN_OPTIONS

log = logging.getLogger(__name__)

AGENT_MODULE = "trtglm.serve.rank_agent"
STOP_SIGNAL = signal.SIGUSR1  # an orderly stop, which mpirun passes on to every rank (Open MPI 4 and 5 forward it)
CHECK_MARK = "trtglm-host-check"
RETRY_S = 5.0  # between checks of hosts mpirun could not reach
CHECK_TIMEOUT_S = 120.0
# The check that runs on each host: every path that is missing, then a last line saying it ran.
CHECK_SCRIPT = (f'h=$1; shift; for p do [ -e "$p" ] || echo "{CHECK_MARK} $h missing $p"; done; '
                f'echo "{CHECK_MARK} $h done"')


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int


def read_hosts(hosts: str | None, hostfile: str | None) -> tuple[HostSlots, ...] | None:
    """The hosts of `--hosts a,b:2` or of an Open MPI hostfile (`HOST [slots=N]` a line, # comments); None
    when neither is given."""
    if hosts and hostfile:
        raise UsageError("give --hosts or --hostfile, not both")
    if hosts:
        entries = [_entry(item.replace(":", " slots=", 1), "--hosts") for item in hosts.split(",") if item.strip()]
    elif hostfile:
        try:
            lines = Path(hostfile).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise UsageError(f"--hostfile {hostfile}: {e.strerror}") from None
        entries = [_entry(line.split("#", 1)[0], f"{hostfile} line {number}")
                   for number, line in enumerate(lines, 1) if line.split("#", 1)[0].strip()]
    else:
        return None
    if not entries:
        raise UsageError(f"{'--hosts' if hosts else hostfile}: no hosts in it")
    names = [entry.host for entry in entries]
    if len(set(names)) < len(names):
        raise UsageError(f"{'--hosts' if hosts else hostfile}: a host is named twice ({', '.join(names)})")
    return tuple(entries)


def _entry(text: str, where: str) -> HostSlots:
    host, *settings = text.split()
    slots = 1
    for setting in settings:
        key, _, value = setting.partition("=")
        if key != "slots" or not re.fullmatch(r"[1-9][0-9]*", value):
            raise UsageError(f"{where}: {setting!r} is not slots=N (a whole number ≥ 1)")
        slots = int(value)
    return HostSlots(host, slots)


def rank_hosts(hosts: Sequence[HostSlots], world_size: int) -> list[str]:
    """The host of each rank: the hosts' slots in order."""
    placed = [entry.host for entry in hosts for _ in range(entry.slots)]
    if len(placed) < world_size:
        raise UsageError(f"--world-size {world_size} needs {world_size} host slots; the hosts have {len(placed)} "
                         f"({', '.join(f'{e.host}: {e.slots}' for e in hosts)})")
    return placed[:world_size]


def check_first_host(hosts: Sequence[HostSlots]) -> None:
    """The first host must be this machine: rank 0 serves there, and the supervisor watches it."""
    first = hosts[0].host
    if not is_this_machine(first):
        raise UsageError(f"the first host, {first}, is not this machine: rank 0 runs on the first host and serves "
                         "the endpoints there; launch from it, or name this machine first")


def is_this_machine(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise UsageError(f"host {host}: cannot resolve it ({e.strerror})") from None
    here = {address.address.split("%")[0] for entries in psutil.net_if_addrs().values() for address in entries}
    return bool(addresses & here)


def free_port() -> int:
    """A TCP port free on this machine now (where rank 0 listens for the others)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def host_env(env: dict[str, str], hosts: Sequence[HostSlots], master_port: int) -> dict[str, str]:
    """The ranks' environment for several hosts: where they meet, and none of one host's loopback settings."""
    env = dict(env)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if env.get(name) == "lo":
            del env[name]
    env.update(MASTER_ADDR=hosts[0].host, MASTER_PORT=str(master_port))
    if len(hosts) > 1:
        env["TRTGLM_ONE_SHOT_ALL_REDUCE"] = "0"  # symmetric memory needs every rank's GPU on one host
    return env


def host_args(hosts: Sequence[HostSlots], rsh_agent: str | None) -> list[str]:
    """mpirun's options for the hosts (Open MPI 4 and 5 alike: 5's mpirun passes plm_rsh_agent on to PRRTE)."""
    args = ["--host", ",".join(f"{entry.host}:{entry.slots}" for entry in hosts), "--map-by", "slot"]
    return args + _agent_args(rsh_agent)


def _agent_args(rsh_agent: str | None) -> list[str]:
    return ["--mca", "plm_rsh_agent", rsh_agent] if rsh_agent else []


def resolve_hosts(hosts: str | None, hostfile: str | None, rsh_agent: str | None, world_size: int
                  ) -> list[HostSlots] | None:
    """The hosts of `--hosts` or `--hostfile`, checked (the first is this machine, their slots hold the ranks); None
    when not given, or for one rank (which runs here, with no mpirun)."""
    entries = read_hosts(hosts, hostfile)
    if entries is None:
        if rsh_agent:
            raise UsageError("--rsh-agent needs --hosts or --hostfile")
        return None
    check_first_host(entries)
    rank_hosts(entries, world_size)
    return list(entries) if world_size > 1 else None


def agent_args(log_dir: str | Path, drain_s: float) -> list[str]:
    """The rank agent before a rank's tritonserver command line (this Python, found at the same path on every host)."""
    return [sys.executable, "-m", AGENT_MODULE, "--log-dir", str(log_dir), "--drain", f"{drain_s:g}", "--"]


# --- what must be on every host -------------------------------------------------------------------------------


def needed_paths(repo: Path, ranks: Sequence[int]) -> list[str]:
    """What a host running `ranks` needs: the repository, its tensorrt_llm model, the engine folder, its description
    and those ranks' files (a TensorRT engine's rank{r}.engine, trtglm's runtime's checkpoint rank{r}.safetensors)."""
    paths = [repo, repo / TENSORRT_LLM / CONFIG]
    folder = engine_dir(repo)
    if folder is not None:
        name, _ = engine_description(folder)
        manifest = read_manifest(folder) if name == MANIFEST else None
        paths += [folder, folder / name]
        if manifest is not None and manifest.engine == "torch":
            paths += [manifest.checkpoint_dir / f"rank{rank}.safetensors" for rank in ranks]
        else:
            paths += [folder / f"rank{rank}.engine" for rank in ranks]
    return [str(path) for path in paths]


def check_hosts(mpirun: str | Path, rsh_agent: str | None, repo: Path, entries: Sequence[HostSlots], world_size: int,
                deadline: float) -> None:
    """Run the check on every host (through mpirun and its remote shell, one host at a time, so that each answer is
    that host's); ModelFileError naming a host that lacks a path, UsageError naming one that mpirun could not reach
    by `deadline` (time.monotonic())."""
    placed = rank_hosts(entries, world_size)
    waiting = list(dict.fromkeys(placed))
    while True:
        unreached = {}
        for host in waiting:
            ranks = [rank for rank, where in enumerate(placed) if where == host]
            missing, output = _check_host(mpirun, rsh_agent, host, needed_paths(repo, ranks))
            if missing:
                raise ModelFileError(f"host {host} lacks {', '.join(missing)}: the repository and engine must be on "
                                     "every host, under the same paths")
            if missing is None:
                unreached[host] = output
        if not unreached:
            return
        if time.monotonic() + RETRY_S > deadline:
            host, output = next(iter(unreached.items()))
            raise UsageError(f"mpirun could not run anything on host {host} ({_about(host, output)})")
        log.info("waiting for %s (mpirun cannot reach it yet)", ", ".join(unreached))
        waiting = list(unreached)
        time.sleep(RETRY_S)


def _about(host: str, output: str) -> str:
    """What mpirun and its remote shell said of `host` (the lines that name it), else their last lines."""
    lines = [" ".join(line.split()) for line in output.splitlines() if line.strip()]
    named = list(dict.fromkeys(line for line in lines if host in line))
    return " / ".join(named[:3] or lines[-3:]) or "no output"


def _check_host(mpirun: str | Path, rsh_agent: str | None, host: str, paths: list[str]
                ) -> tuple[list[str] | None, str]:
    """(the paths missing on `host`, or None when the check did not run there; mpirun's output)."""
    argv = [str(mpirun), *MPIRUN_OPTIONS, *_agent_args(rsh_agent), "-n", "1", "--host", host,
            "/bin/sh", "-c", CHECK_SCRIPT, "sh", host, *paths]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        output = f"{e.stdout or ''}no answer within {CHECK_TIMEOUT_S:g} s"
    said = [line.split(" ", 2)[2] for line in output.splitlines()
            if line.startswith(f"{CHECK_MARK} {host} ") and len(line.split(" ", 2)) == 3]
    if "done" not in said:
        return None, output
    return [line.removeprefix("missing ") for line in said if line.startswith("missing ")], output
