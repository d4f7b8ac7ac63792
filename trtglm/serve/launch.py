"""`trtglm launch` and `trtglm stop`: a supervised (multi-rank) Triton server for a model repository.

`launch` checks before it starts anything: the repository exists; `--world-size` equals the
engine's tp × pp (read through tensorrt_llm's `gpt_model_path`; the engine's value when the
flag is left out, 1 when the repository has no tensorrt_llm model); tritonserver (and mpirun
for several ranks) can be found; no other launch serves the repository (state.py; the remains
of a dead one are removed first); rank 0's ports (and the OpenAI API's, when it is served: the
repository has a client-facing model and FastAPI and uvicorn are installed) are free on `--host`. Then it runs the
supervisor (supervise.py) in the foreground, or with `--detach` as a daemon, returning once
the server is ready; the daemon keeps watching, so a dying rank still stops the others.

`stop` asks a launch's supervisor to stop (SIGTERM) and waits for it; a supervisor that does
not finish in time is killed and its servers are stopped from the state it left.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from trtglm.errors import DependencyError, TrtglmError, UsageError
from trtglm.model_repository import profile_ports
from trtglm.ports import TRITON_PORTS
from trtglm.serve.checks import check_ports, repo_folder, resolve_world_size
from trtglm.serve.command import EXIT_TIMEOUT_S, Endpoints
from trtglm.serve.fleet import MAX_START_FAILURES, Fleet, FleetSpec, plan_fleet, wants_front
from trtglm.serve.front import find_envoy
from trtglm.serve.hosts import check_hosts, free_port, resolve_hosts
from trtglm.serve.launch_spec import LaunchSpec, fresh_ids, stop_wait_s
from trtglm.serve.replicas import place_replicas
from trtglm.serve.state import LaunchDir, all_launch_dirs, clean_stale, only_launch
from trtglm.serve.preload import preload_library
from trtglm.serve.rank_logs import SUPERVISOR_ERROR, read_log, supervisor_error
from trtglm.serve.status import announce
from trtglm.serve.supervise import Supervisor, show_phase
from trtglm.serve.tritonserver import (backend_directory, find_mpirun, find_tritonserver, mpirun_version,
                                       preload_cache_dir, server_env, stubs_python_folder)

log = logging.getLogger(__name__)

STOP_WAIT_S = stop_wait_s(EXIT_TIMEOUT_S)  # what `stop` waits for a launch that recorded none


def launch(repo: str | Path, *, world_size: int | None, tritonserver: str | None, host: str, http_port: int | None,
           grpc_port: int | None, metrics_port: int | None, log_dir: str | Path | None, detach: bool, timeout: float,
           server_flags: list[str], openai_port: int, openai: bool, drain: float = EXIT_TIMEOUT_S,
           replicas: int = 1, front: bool | None = None, gpus: list[str] | None = None,
           replica_ports: int | None = None, hosts: str | None = None, hostfile: str | None = None,
           rsh_agent: str | None = None) -> None:
    """Serve `repo` with `world_size` ranks until stopped (or, with `detach`, until ready); `server_flags`
    go on every rank's tritonserver command line after trtglm's own; with `openai`, the OpenAI-compatible
    API on `openai_port` too. A port left out is the engine profile's (`serve.*_port`), else Triton's default.
    An orderly stop lets requests in flight finish for `drain` seconds. With `replicas` above 1 (or `front`), that
    many copies behind the front (fleet.py), on `gpus` (default: the visible ones in order) and the port block at
    `replica_ports`. `hosts` / `hostfile`: one replica's ranks on several hosts, reached with mpirun's remote shell
    (`rsh_agent`, default ssh): hosts.py."""
    repo_path = repo_folder(repo)
    size = resolve_world_size(repo_path, world_size)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, not {timeout!r}")
    given = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    ports = {**TRITON_PORTS, **profile_ports(repo_path), **{name: port for name, port in given.items() if port}}
    endpoints = Endpoints(str(host), ports["http"], ports["grpc"], ports["metrics"],
                          openai_port if openai and _serves_openai(repo_path) else None)
    on_hosts = resolve_hosts(hosts, hostfile, rsh_agent, size)
    if (hosts or hostfile) and (replicas != 1 or gpus is not None):
        raise UsageError("--hosts and --hostfile run one replica over several hosts, each host's ranks on its GPUs in "
                         "order: leave out --replicas and --gpus")
    places = (place_replicas(replicas, size, endpoints, replica_ports, gpus, dict(os.environ), not on_hosts)
              if wants_front(replicas, front, endpoints.host) else None)
    envoy = find_envoy() if places else None
    server = _server_fields(repo_path, size, tritonserver, float(timeout), server_flags, float(drain))
    if on_hosts:
        check_hosts(server["mpirun"], rsh_agent, repo_path, on_hosts, size, time.monotonic() + timeout)
        server.update(hosts=on_hosts, rsh_agent=rsh_agent, master_port=free_port())
    launch_dir = LaunchDir.for_repo(repo_path)
    lock = launch_dir.try_lock()
    if lock is None:
        raise UsageError(_already_running(launch_dir, repo_path))
    try:
        if launch_dir.state_file.exists():
            log.info("removing the state of a launch of %s that is no longer running", repo_path)
            clean_stale(launch_dir)
        check_ports(endpoints)
        logs = Path(log_dir).expanduser().resolve() if log_dir else launch_dir.default_log_dir
        if places:
            spec = plan_fleet(server, places, endpoints, envoy, launch_dir, logs, detach)
            log.info("starting %d replica(s) of %d rank(s) of %s behind the front", len(places), size, repo_path)
        else:
            spec = LaunchSpec(**server, endpoints=endpoints, launch_dir=str(launch_dir.path), log_dir=str(logs),
                              detached=detach, **fresh_ids())
            log.info("starting %d rank(s) of %s (%s)", size, server["tritonserver"], repo_path)
        if detach:
            _run_detached(spec, lock.fileno())
        else:
            (Fleet if places else Supervisor)(spec).run()
    finally:
        lock.close()


def _server_fields(repo: Path, size: int, tritonserver: str | None, timeout_s: float, server_flags: list[str],
                   drain_s: float) -> dict:
    """What every replica's LaunchSpec shares: the repository, the binaries and their set-up, the flags."""
    binary = find_tritonserver(tritonserver)
    mpirun = find_mpirun() if size > 1 else None
    backend_dir = backend_directory(binary)
    python_bin = stubs_python_folder(binary)
    return {"repo": str(repo), "world_size": size, "tritonserver": str(binary),
            "backend_dir": str(backend_dir) if backend_dir else None, "mpirun": str(mpirun) if mpirun else None,
            "mpi_version": mpirun_version(mpirun) if mpirun else None,
            "preload": str(preload_library(preload_cache_dir())), "python_bin": str(python_bin) if python_bin else None,
            "timeout_s": timeout_s, "server_flags": tuple(server_flags), "drain_s": drain_s}


def _serves_openai(repo: Path) -> bool:
    """Whether the OpenAI-compatible API can answer for `repo`, whose packages are installed (else an error)."""
    for package in ("fastapi", "uvicorn", "pydantic"):
        if importlib.util.find_spec(package) is None:
            raise DependencyError(f"the OpenAI API needs {package}: pip install 'trtglm[openai]' (or launch with "
                                  "--no-openai)")
    from trtglm.openai_api.served import served_model

    if served_model(repo) is None:
        log.debug("%s has no tensorrt_llm_bls or ensemble with preprocessing: not serving the OpenAI API", repo)
        return False
    return True


def _already_running(launch_dir: LaunchDir, repo: Path) -> str:
    state = launch_dir.read() or {}
    where = f" at {state['urls']['http']}" if state.get("urls") else ""
    return (f"{repo} is already being served (supervisor pid {state.get('pid', '?')}{where}); "
            f"stop it first: trtglm stop --repo {repo}")


# --- detached ----------------------------------------------------------------------------------------


def _run_detached(spec: LaunchSpec | FleetSpec, lock_fd: int) -> None:
    """Start the supervisor (or the fleet of replicas) as a daemon holding the lock; return once it reports the
    server ready."""
    launch_dir = LaunchDir(Path(spec.launch_dir))
    spec_path = launch_dir.path / "spec.json"
    spec.save(spec_path)
    log_path = Path(spec.log_dir) / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, FleetSpec):  # its replicas' supervisors set up their own servers' environment
        module, env, tries = "trtglm.serve.fleet", dict(os.environ), MAX_START_FAILURES
        phase_file = LaunchDir(Path(spec.replicas[0].launch_dir)).phase_file
    else:
        module, env, tries = "trtglm.serve.supervise", server_env(dict(os.environ), spec.launch_id, spec.python_bin), 1
        phase_file = launch_dir.phase_file
    with open(log_path, "wb") as out:
        child = subprocess.Popen([sys.executable, "-m", module, str(spec_path)], env=env,
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, pass_fds=(lock_fd,))
    try:
        state = _wait_detached(child, launch_dir, phase_file, log_path, spec.timeout_s * tries + spec.stop_wait_s)
    except BaseException:
        if child.poll() is None:  # interrupted or timed out: the supervisor cleans up on SIGTERM
            child.terminate()
            child.wait(spec.stop_wait_s)
        raise
    announce(state)
    print(f"  stop     trtglm stop --repo {spec.repo}", flush=True)


def _wait_detached(child: subprocess.Popen, launch_dir: LaunchDir, phase_file: Path, log_path: Path,
                   limit_s: float) -> dict:
    started = time.monotonic()
    with tqdm(desc="starting tritonserver", unit="s", disable=None, bar_format="{desc}: {elapsed}") as bar:
        while time.monotonic() - started < limit_s:
            state = launch_dir.read()
            if state and state.get("pid") == child.pid and state.get("status") == "ready":
                return state
            code = child.poll()
            if code is not None:
                raise _supervisor_failed(log_path, code)
            time.sleep(0.2)
            show_phase(bar, phase_file, started)
    raise TrtglmError(f"the detached supervisor did not report within {limit_s:g} s (log: {log_path})")


def _supervisor_failed(log_path: Path, code: int) -> TrtglmError:
    """The supervisor's own error line as the error; the rest of its log's tail on stderr."""
    lines = read_log(log_path).splitlines()
    shown = [line for line in lines[-80:] if not line.startswith(SUPERVISOR_ERROR)]
    if shown:
        print(*shown, sep="\n", file=sys.stderr)
    error = TrtglmError(supervisor_error(log_path) or f"the server stopped (status {code}; log: {log_path})")
    error.exit_code = code or 1
    return error


# --- stop ----------------------------------------------------------------------------------------


def stop(repo: str | Path | None) -> None:
    """Stop the launch serving `repo` (default: the only running launch)."""
    launch_dir = _launch_to_stop(repo)
    if launch_dir is None:
        return
    state = _wait_for_state(launch_dir)
    pid = state.get("pid")
    _send(pid, signal.SIGTERM)
    limit_s = state.get("stop_wait_s", STOP_WAIT_S)
    if not _wait_unlocked(launch_dir, limit_s):
        log.warning("supervisor %s did not stop within %g s; killing it", pid, limit_s)
        _send(pid, signal.SIGKILL)
        _wait_unlocked(launch_dir, 5)
    _clean_if_stale(launch_dir)
    print(f"stopped {state.get('repo')}", flush=True)


def _launch_to_stop(repo: str | Path | None) -> LaunchDir | None:
    if repo is not None:
        path = Path(repo).expanduser().resolve()
        launch_dir = LaunchDir.for_repo(path)
        if launch_dir.is_running():
            return launch_dir
        if _clean_if_stale(launch_dir):
            print(f"no launch of {path} was running; removed what a dead one left", flush=True)
            return None
        raise UsageError(f"no launch of {path} is running")
    running = []
    for launch_dir in all_launch_dirs():
        if launch_dir.is_running():
            running.append(launch_dir)
        else:
            _clean_if_stale(launch_dir)
    return only_launch(running, "running")


def _clean_if_stale(launch_dir: LaunchDir) -> bool:
    """Remove a dead launch's remains; True if there were any."""
    if not launch_dir.state_file.exists():
        return False
    lock = launch_dir.try_lock()
    if lock is None:
        return False
    try:
        clean_stale(launch_dir)
    finally:
        lock.close()
    return True


def _wait_for_state(launch_dir: LaunchDir, limit_s: float = 10.0) -> dict:
    """A supervisor writes its state right after taking the lock; wait for it briefly."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = launch_dir.read()
        if state and state.get("pid"):
            return state
        time.sleep(0.1)
    raise TrtglmError(f"{launch_dir.path}: a launch holds the lock but wrote no state; try again")


def _wait_unlocked(launch_dir: LaunchDir, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not launch_dir.is_running():
            return True
        time.sleep(0.1)
    return False


def _send(pid: int | None, signum: int) -> None:
    if pid:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
