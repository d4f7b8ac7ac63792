"""What `trtglm status` and `trtglm logs` read: the recorded launches (state.py), whether each one's
supervisor still runs and its server answers ready, and the tails of its log files."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from trtglm.errors import UsageError
from trtglm.serve.front import LOG_NAME as FRONT_LOG
from trtglm.serve.openai_process import LOG_NAME
from trtglm.serve.rank_logs import rank_logs
from trtglm.serve.state import LaunchDir, all_launch_dirs, only_launch

READY_TIMEOUT_S = 2.0


def launch_rows() -> list[dict]:
    """One row per recorded launch: repo, state (starting | ready | stopping | dead), pid, ports, ready (its
    HTTP endpoint and, when served, the OpenAI API answer), front (whether a proxy serves those ports), replicas
    (each: index, gpus, state, ports, restarts, reason; a launch without a front is its own one replica)."""
    rows = []
    for launch_dir in all_launch_dirs():
        state = launch_dir.read() or {}
        running = launch_dir.is_running()
        status = state.get("status", "?") if running else "dead"
        replicas = [_replica_row(replica, running) for replica in state.get("replicas", ())] or [
            {"index": 0, "gpus": _own_gpus(state), "state": status, "ports": state.get("ports", {}), "restarts": 0,
             "reason": None}]
        rows.append({"repo": state.get("repo", str(launch_dir.path)), "pid": state.get("pid"), "state": status,
                     "ports": state.get("ports", {}), "front": bool(state.get("replicas")),
                     "ready": running and is_ready(state.get("urls", {}).get("http")) and openai_answers(state),
                     "replicas": replicas})
    return rows


def _replica_row(replica: dict, running: bool) -> dict:
    return {"index": replica["index"], "gpus": replica.get("gpus"),
            "state": replica.get("status", "?") if running else "dead", "ports": replica.get("ports", {}),
            "restarts": replica.get("restarts", 0), "reason": replica.get("reason")}


def _own_gpus(state: dict) -> list[str] | None:
    value = state.get("cuda_visible_devices")
    return None if value is None else [gpu for gpu in value.split(",") if gpu]


def is_ready(http_url: str | None) -> bool:
    return bool(http_url) and _answers(f"{http_url}/v2/health/ready")


def openai_answers(state: dict) -> bool:
    """Whether the launch's OpenAI API answers its /health (True when it serves none)."""
    url = state.get("urls", {}).get("openai")
    return not url or _answers(f"{url.removesuffix('/v1')}/health")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=READY_TIMEOUT_S) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def recorded_launch(repo: str | None) -> LaunchDir:
    """The launch of `repo`, or with none given the only launch recorded."""
    if repo is not None:
        launch_dir = LaunchDir.for_repo(Path(repo).expanduser())
        if launch_dir.read() is None:
            raise UsageError(f"no launch of {Path(repo).expanduser().resolve()} is recorded")
        return launch_dir
    return only_launch(all_launch_dirs(), "recorded")


def log_tails(launch_dir: LaunchDir, rank: int, lines: int, replica: int | None = None) \
        -> list[tuple[Path, list[str]]]:
    """(file, its last `lines` lines) for the rank's stdout and stderr, the supervisor's log and the OpenAI API's;
    of a launch of replicas, those of `replica` (required) and the front's."""
    state = launch_dir.read() or {}
    log_dir = Path(state.get("log_dir") or launch_dir.default_log_dir)
    replicas = state.get("replicas", [])
    files = []
    if replicas:
        if replica is None or not 0 <= replica < len(replicas):
            raise UsageError(f"{state.get('repo')} runs {len(replicas)} replicas: pass --replica 0 to "
                             f"{len(replicas) - 1}")
        files = [log_dir / "supervisor.log", log_dir / FRONT_LOG]
        log_dir = Path(replicas[replica]["log_dir"])
    elif replica not in (None, 0):
        raise UsageError(f"{state.get('repo')} runs one replica: --replica can only be 0")
    world_size = (replicas[replica] if replicas else state).get("world_size", state.get("world_size"))
    if world_size is not None and rank >= world_size:
        raise UsageError(f"--rank {rank}: the launch has {world_size} rank(s) (0 to {world_size - 1})")
    files = [*rank_logs(log_dir, rank), log_dir / "supervisor.log", log_dir / "mpirun.log", log_dir / LOG_NAME,
             *files]
    return [(path, _tail(path, lines)) for path in files if path.is_file()]


def _tail(path: Path, lines: int) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as text:
        return [line.rstrip("\n") for line in deque(text, maxlen=lines)]


def announce(state: dict) -> None:
    """Print where the server answers."""
    urls = state.get("urls", {})
    openai = f"  OpenAI   {urls['openai']}\n" if urls.get("openai") else ""
    replicas = len(state.get("replicas", ()))
    what = f"{replicas} replica(s) of " if replicas else ""
    print(f"serving {state.get('repo')} with {what}{state.get('world_size')} rank(s)\n"
          f"  HTTP     {urls.get('http')}\n  gRPC     {urls.get('grpc')}\n  metrics  {urls.get('metrics')}\n"
          f"{openai}  logs     {state.get('log_dir')}", flush=True)
