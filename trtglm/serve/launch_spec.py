"""`LaunchSpec`: everything a supervisor needs to start and watch one launch, saved as JSON so that a
detached supervisor (`python -m trtglm.serve.supervise SPEC.json`) reads what `trtglm launch` decided."""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtglm.serve.command import EXIT_TIMEOUT_S, Endpoints, launch_args, restricted_args
from trtglm.serve.hosts import STOP_SIGNAL, HostSlots, agent_args, host_args, host_env
from trtglm.serve.preload import preload_env
from trtglm.serve.tritonserver import EXPORTED_VARS

STOP_MARGIN_S = 5.0  # after the drain, for a stopped server to unload and exit before it is killed


def stop_wait_s(drain_s: float) -> float:
    """How long `trtglm stop` waits for a supervisor's orderly stop (the OpenAI API's grace, then the ranks')."""
    return 2 * (drain_s + STOP_MARGIN_S) + 10


def fresh_ids() -> dict[str, str]:
    """A new launch's id (its shared-memory prefix, its processes' mark) and its restricted APIs' secret."""
    return {"launch_id": secrets.token_hex(4), "api_key": secrets.token_urlsafe(24)}


@dataclass
class LaunchSpec:
    """Everything the supervisor needs; JSON-serialisable so a detached supervisor can read it."""

    repo: str
    world_size: int
    endpoints: Endpoints
    tritonserver: str
    backend_dir: str | None
    mpirun: str | None
    launch_dir: str
    log_dir: str
    launch_id: str
    timeout_s: float
    detached: bool = False
    python_bin: str | None = None  # the stubs' Python's folder (stub_python.py); None: this Python's
    api_key: str | None = None  # the restricted APIs' secret (command.py); in the launch folder only its user reads
    server_flags: tuple[str, ...] = ()  # more tritonserver flags, from `trtglm launch … -- FLAGS`
    mpi_version: int | None = None  # Open MPI's major version, for several ranks
    preload: str | None = None  # the library preloaded into the server processes (preload.py)
    environment: dict[str, str] = field(default_factory=dict)  # set for the servers: a replica's GPUs
    cpus: tuple[int, ...] | None = None  # the CPUs the launch's processes may use (a replica's share); None: all
    drain_s: float = EXIT_TIMEOUT_S  # an orderly stop lets requests in flight finish this long (`launch --drain`)
    hosts: list[HostSlots] | None = None  # ranks on several hosts (hosts.py), the first this one; None: this host
    rsh_agent: str | None = None  # mpirun's remote shell to the other hosts (None: its own, ssh)
    master_port: int | None = None  # where rank 0 listens for the other hosts' ranks

    @property
    def grace_s(self) -> float:
        """How long an orderly stop waits for the OpenAI API, then for the ranks, before killing what is left."""
        return self.drain_s + STOP_MARGIN_S

    @property
    def stop_wait_s(self) -> float:
        return stop_wait_s(self.drain_s)

    @property
    def watched_ranks(self) -> int:
        """The ranks the supervisor must see run here before it calls the launch ready: all, or on several hosts
        rank 0 (the others' agents watch them on their hosts)."""
        return 1 if self.hosts else self.world_size

    def rank_env(self, env: dict[str, str]) -> dict[str, str]:
        """The servers' environment `env`, for ranks on several hosts where there are."""
        return host_env(env, self.hosts, self.master_port) if self.hosts else env

    def stop_other_hosts(self, mpirun: subprocess.Popen) -> None:
        """An orderly stop of the ranks on other hosts: their agents' signal, which mpirun passes on (hosts.py)."""
        if self.hosts and mpirun.poll() is None:
            mpirun.send_signal(STOP_SIGNAL)

    @property
    def shm_base(self) -> str:
        return f"trtglm{self.launch_id}_rank"

    def command(self, env: dict[str, str]) -> list[str]:
        exports = [name for name in (*EXPORTED_VARS, "TRTGLM_LAUNCH_ID", "MASTER_ADDR", "MASTER_PORT") if name in env]
        on_hosts = {"host_args": host_args(self.hosts, self.rsh_agent),
                    "rank_prefix": agent_args(self.log_dir, self.drain_s)} if self.hosts else {}
        return launch_args(self.tritonserver, self.repo, self.world_size, self.endpoints,
                           mpirun=self.mpirun or "mpirun", mpi_version=self.mpi_version or 4, shm_base=self.shm_base,
                           backend_dir=self.backend_dir, export_vars=exports, exit_timeout_s=math.ceil(self.drain_s),
                           cpu_count=os.cpu_count() or 1, server_flags=self.server_flags,
                           output_dir=None if self.hosts else Path(self.log_dir) / "ranks",  # agents write their own
                           **on_hosts)

    def preload_vars(self, env: dict[str, str]) -> dict[str, str]:
        """The variables that preload the library into the server processes of `env` (none without one): rank 0's
        restricted-API flags, and mpirun's listeners on loopback."""
        if self.preload is None:
            return {}
        hidden = restricted_args(self.api_key) if self.api_key else []
        return preload_env(Path(self.preload), hidden, self.world_size > 1 and not self.hosts,
                           env.get("LD_PRELOAD", ""))

    def save(self, path: Path) -> None:
        """Write the spec readable by this user alone (it holds the API key)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> LaunchSpec:
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    @classmethod
    def from_dict(cls, data: dict) -> LaunchSpec:
        data = dict(data)
        data["endpoints"] = Endpoints(**data["endpoints"])
        data["server_flags"] = tuple(data.get("server_flags", ()))
        data["cpus"] = tuple(data["cpus"]) if data.get("cpus") is not None else None
        data["hosts"] = [HostSlots(**entry) for entry in data["hosts"]] if data.get("hosts") else None
        return cls(**data)
