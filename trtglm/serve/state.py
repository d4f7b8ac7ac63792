"""Where a launch keeps its state, and how a dead launch's remains are found and removed.

Each repository (by absolute path) has a launch folder under the state root
(`$TRTGLM_STATE_DIR`, default `$XDG_CACHE_HOME/trtglm/launches` or `~/.cache/…`):

    lock            flock()ed by the supervising process for as long as it lives
    state.json      repo, supervisor pid, endpoints, logs, shm base, status (starting | ready)
    logs/           default log folder: ranks/…/rank.N/{stdout,stderr}, mpirun.log, supervisor.log

A launch is running exactly when its lock is held, so a supervisor that died (even by
SIGKILL) leaves stale state that the next `launch` or `stop` recognises. Its servers may
still run: every process of a launch carries the launch's unique shm base in its command line
(mpirun and tritonserver in `--backend-config`, python stubs in their shm region name), which
is how leftovers are found; leftover /dev/shm regions start with the same base.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from trtglm.engine.manifest import write_json_atomic
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
STATE = "state.json"
SHM_BASE = re.compile(r"trtglm[0-9a-f]{8}_rank")  # what launch_spec.LaunchSpec.shm_base makes


def state_root() -> Path:
    if os.environ.get("TRTGLM_STATE_DIR"):
        return Path(os.environ["TRTGLM_STATE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtglm" / "launches"


@dataclass(frozen=True)
class LaunchDir:
    """The state folder of one repository."""

    path: Path

    @classmethod
    def for_repo(cls, repo: Path) -> LaunchDir:
        repo = repo.resolve()
        key = hashlib.sha256(str(repo).encode()).hexdigest()[:12]
        return cls(state_root() / f"{repo.name}-{key}")

    @property
    def state_file(self) -> Path:
        return self.path / STATE

    @property
    def phase_file(self) -> Path:
        """Where the starting engine says which phase of its start it is in (files.report_phase)."""
        return self.path / "phase.json"

    @property
    def default_log_dir(self) -> Path:
        return self.path / "logs"

    def read(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    def write(self, state: dict) -> None:
        write_json_atomic(self.state_file, state)

    def make(self) -> None:
        """Create the folder, readable by its user alone (it holds the launch's API key)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.path.chmod(0o700)

    def api_key(self) -> str | None:
        """The running launch's secret for Triton's restricted APIs, if this user can read it."""
        return (self.read() or {}).get("api_key")

    def try_lock(self) -> IO | None:
        """The open, locked lock file, or None when another process holds the lock."""
        self.make()
        handle = open(self.path / "lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return handle

    def is_running(self) -> bool:
        if not (self.path / "lock").exists():
            return False
        handle = self.try_lock()
        if handle is None:
            return True
        handle.close()
        return False


def all_launch_dirs() -> list[LaunchDir]:
    root = state_root()
    return [LaunchDir(p) for p in sorted(root.iterdir()) if (p / STATE).is_file()] if root.is_dir() else []


def only_launch(launches: list[LaunchDir], what: str) -> LaunchDir:
    """The one launch of `launches` (those `what`: running, recorded); a UsageError asking for --repo otherwise."""
    if not launches:
        raise UsageError(f"no launch is {what}")
    if len(launches) > 1:
        repos = ", ".join(str((d.read() or {}).get("repo", d.path)) for d in launches)
        raise UsageError(f"{len(launches)} launches are {what} ({repos}): pass --repo")
    return launches[0]


def clean_stale(launch: LaunchDir) -> None:
    """Remove what a dead launch left (the caller holds its lock): processes, shm regions, state file; for a
    launch of replicas, its front's process and what each replica left."""
    state = launch.read() or {}
    if state.get("front_marker"):
        _stop_leftovers(processes_with(state["front_marker"]), state)
    for replica in state.get("replicas", ()):
        folder = LaunchDir(Path(replica["launch_dir"]))
        lock = folder.try_lock()
        if lock is not None:
            with lock:
                clean_stale(folder)
    if SHM_BASE.fullmatch(str(state.get("shm_base"))):
        _stop_leftovers(processes_with(state["shm_base"]), state)
        remove_shm(state["shm_base"])
    launch.state_file.unlink(missing_ok=True)


def _stop_leftovers(leftovers: list[psutil.Process], state: dict) -> None:
    if leftovers:
        log.warning("stopping %d leftover process(es) of a dead launch of %s", len(leftovers), state.get("repo"))
        terminate(leftovers, grace_s=5)


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes (not this one) whose command line contains `marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and any(marker in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, wait up to `grace_s`, SIGKILL what is left."""
    for proc in procs:
        _signal(proc, psutil.Process.terminate)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    kill(alive)


def kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        _signal(proc, psutil.Process.kill)
    psutil.wait_procs(procs, timeout=5)


def _signal(proc: psutil.Process, send) -> None:
    try:
        send(proc)
    except psutil.Error:
        pass


def shm_files(shm_base: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{shm_base}*")) if SHM_DIR.is_dir() else []


def remove_shm(shm_base: str) -> None:
    for path in shm_files(shm_base):
        log.debug("removing leftover shared memory %s", path)
        path.unlink(missing_ok=True)
