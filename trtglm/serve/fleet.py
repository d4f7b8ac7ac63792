"""A launch of several replicas behind the front: `trtglm launch --replicas N` (or `--front`).

Each replica is a supervised launch of its own: a supervisor process (`python -m trtglm.serve.supervise SPEC`,
supervise.py) with its own tritonserver (mpirun for several ranks), engine processes, ports, GPUs, state folder
and logs. This process, the fleet, holds the repository's launch folder, runs the front (front.py: Envoy on the
ports users know) and one supervisor per replica, and watches them every POLL_S:

- a replica whose supervisor reports ready is put in the front's rotation; one that reports it is stopping (a
  process of it died) or whose supervisor exits is taken out at once, so that only the streams in flight on it
  fail;
- a replica that ended after having been ready is started again, with the same ports and GPUs; one that fails
  MAX_START_FAILURES times in a row before it gets ready is given up on, its reason kept in the state and shown
  by `trtglm status`; when every replica is given up on, the launch fails;
- the front's death stops the launch (a deployment's orchestrator starts it again).

Ready means: every replica is ready or given up on, at least one is ready, and the front answers
/v2/health/ready. Stopping (SIGINT, SIGTERM, SIGHUP; `trtglm stop`): the front stops taking new connections,
every replica's supervisor is stopped as a launch is (SIGTERM: its streams in flight get the grace period), then
the front. A replica's supervisor and Envoy are told to stop (SIGTERM) if this process dies, however it dies.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtglm.errors import TrtglmError, UsageError
from trtglm.serve.checks import check_ports
from trtglm.serve.command import Endpoints
from trtglm.serve.front import Front
from trtglm.serve.launch_spec import STOP_MARGIN_S, LaunchSpec, fresh_ids
from trtglm.serve.replicas import ReplicaPlace, front_cpus
from trtglm.serve.reaping import become_subreaper, reap_orphans
from trtglm.serve.state import LaunchDir, clean_stale
from trtglm.serve.rank_logs import supervisor_error
from trtglm.serve.signals import SignalFlags
from trtglm.serve.supervise import POLL_S, Failure, answers_ok, announce, run_detached
from trtglm.serve.tritonserver import server_env

log = logging.getLogger(__name__)

MAX_START_FAILURES = 3  # in a row, before a replica gets ready: then it is given up on
RESTART_DELAY_S = 1.0  # before a replica that ended is started again; doubled for each failure in a row
FRONT_READY_S = 30.0  # for the front to answer once its replicas are ready
PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass
class FleetSpec:
    """Everything the fleet needs; JSON, so that a detached fleet reads what `trtglm launch` decided."""

    repo: str
    front: Endpoints
    replicas: list[LaunchSpec]
    gpus: list[list[str] | None]
    envoy: str
    launch_dir: str
    log_dir: str
    timeout_s: float
    detached: bool = False
    front_cpus: tuple[int, ...] | None = None  # Envoy's CPUs: none of an engine's

    @property
    def stop_wait_s(self) -> float:
        """How long an orderly stop may take: the replicas' (each its drain, launch_spec.py), then the front's and
        the cleaning up."""
        return max(replica.stop_wait_s for replica in self.replicas) + 2 * STOP_MARGIN_S

    def save(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the replicas' specs hold API keys
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> FleetSpec:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["front"] = Endpoints(**data["front"])
        data["replicas"] = [LaunchSpec.from_dict(replica) for replica in data["replicas"]]
        data["front_cpus"] = tuple(data["front_cpus"]) if data.get("front_cpus") else None
        return cls(**data)


def wants_front(replicas: int, front: bool | None, host: str) -> bool:
    """Whether the launch runs behind the front: with several replicas, or (unless --no-front) whenever its ports
    are reachable beyond this machine, or when asked for."""
    if front is False and isinstance(replicas, int) and replicas > 1:
        raise UsageError("--replicas above 1 serves through the front: leave out --no-front")
    if front is None:
        return replicas != 1 or not is_loopback(host)
    return front


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may be reached from elsewhere
        return False


def plan_fleet(server: dict, places: list[ReplicaPlace], front: Endpoints, envoy: Path, launch_dir: LaunchDir,
               log_dir: Path, detached: bool) -> FleetSpec:
    """The fleet's spec: each replica's LaunchSpec (`server`: the fields they share) in a folder of its own, its
    ports checked free and apart from every other's."""
    taken = {port: "the front's" for port in front.ports().values()}
    for place in places:
        owner = f"replica {place.index}'s"
        check_ports(place.endpoints, flag=lambda name, owner=owner: f"{owner} {name} port (--replica-ports)")
        for port in place.endpoints.ports().values():
            if port in taken:
                raise UsageError(f"{owner} ports (--replica-ports) overlap {taken[port]} at {port}")
            taken[port] = owner
    replicas = [LaunchSpec(**server, endpoints=place.endpoints, launch_dir=str(launch_dir.path / f"replica-{place.index}"),
                           log_dir=str(log_dir / f"replica-{place.index}"), detached=True,
                           environment=place.environment(), cpus=place.cpus, **fresh_ids())
                for place in places]
    return FleetSpec(repo=server["repo"], front=front, replicas=replicas,
                     gpus=[list(place.gpus) if place.gpus is not None else None for place in places],
                     envoy=str(envoy), launch_dir=str(launch_dir.path), log_dir=str(log_dir),
                     timeout_s=server["timeout_s"], detached=detached,
                     front_cpus=front_cpus(places, server["world_size"]))


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when the process that started it ends (Linux)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class Replica:
    """One replica's supervisor process and what the fleet knows of it."""

    index: int
    spec: LaunchSpec
    gpus: list[str] | None
    status: str = "starting"  # starting | ready | stopping | restarting | failed
    restarts: int = 0
    failures_in_a_row: int = 0
    reason: str | None = None  # why it last ended (or was given up on)
    popen: subprocess.Popen | None = field(default=None, repr=False)
    restart_at: float | None = None

    @property
    def folder(self) -> LaunchDir:
        return LaunchDir(Path(self.spec.launch_dir))

    @property
    def log_path(self) -> Path:
        return Path(self.spec.log_dir) / "supervisor.log"

    def start(self) -> None:
        folder = self.folder
        lock = folder.try_lock()
        if lock is None:
            raise TrtglmError(f"replica {self.index}: its state folder {folder.path} is held by another process")
        try:
            if folder.state_file.exists():
                clean_stale(folder)
            spec_path = folder.path / "spec.json"
            self.spec.save(spec_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            env = server_env(dict(os.environ), self.spec.launch_id, self.spec.python_bin)
            with open(self.log_path, "ab") as out:
                self.popen = subprocess.Popen([sys.executable, "-m", "trtglm.serve.supervise", str(spec_path)],
                                              env=env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              pass_fds=(lock.fileno(),), preexec_fn=die_with_parent)
        finally:
            lock.close()
        self.status, self.restart_at = "starting", None

    def reported(self) -> str | None:
        """The status its supervisor last wrote (starting, ready, stopping), while its process runs."""
        return (self.folder.read() or {}).get("status") if self.popen is not None else None

    def row(self) -> dict:
        return {"index": self.index, "gpus": self.gpus, "status": self.status, "restarts": self.restarts,
                "reason": self.reason, "pid": self.popen.pid if self.popen else None,
                "ports": self.spec.endpoints.ports(), "urls": self.spec.endpoints.urls(),
                "launch_dir": self.spec.launch_dir, "log_dir": self.spec.log_dir, "shm_base": self.spec.shm_base}


class Fleet:
    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.launch = LaunchDir(Path(spec.launch_dir))
        self.replicas = [Replica(i, replica, gpus) for i, (replica, gpus) in enumerate(zip(spec.replicas, spec.gpus))]
        self.front = Front(Path(spec.envoy), spec.front, [r.endpoints for r in spec.replicas],
                           self.launch.path / "front", Path(spec.log_dir), spec.front_cpus)
        self.signals = SignalFlags()
        self.ready = False

    # --- the whole life --------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped by a signal (returns), or until the front dies or every replica is given up on."""
        previous = self.signals.install(self._forward_hurry)
        become_subreaper()
        failure = None
        try:
            failure = self._serve()
        finally:
            self.shutdown()
            self.launch.state_file.unlink(missing_ok=True)
            self.signals.restore(previous)
        if failure is not None:
            raise TrtglmError(failure.message)
        if self.signals.stop is not None:
            log.info("%s: stopped (%s)", self.spec.repo, signal.Signals(self.signals.stop).name)

    def _serve(self) -> Failure | None:
        Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
        self.front.start(preexec=die_with_parent)
        self.write_state("starting")
        self.front.wait_ready()
        for replica in self.replicas:
            replica.start()
        self.write_state("starting")
        return self.watch()

    # --- watching --------------------------------------------------------------------------------------

    def watch(self) -> Failure | None:
        replicas_ready_at = None
        while self.signals.stop is None:
            if self.front.died():
                return Failure(f"the front (envoy) exited with status {self.front.popen.returncode}: "
                               f"{self.front.last_error()}; stopped every replica (logs: {self.spec.log_dir})", [])
            if any([self.check(replica) for replica in self.replicas]):
                self.write_state("ready" if self.ready else "starting")
            if all(r.status == "failed" for r in self.replicas):
                reasons = "; ".join(f"replica {r.index}: {r.reason}" for r in self.replicas)
                return Failure(f"every replica failed ({reasons}) (logs: {self.spec.log_dir})", [])
            if not self.ready and self._replicas_settled():
                replicas_ready_at = replicas_ready_at or time.monotonic()
                if answers_ok(self.spec.front.urls()["http"] + "/v2/health/ready"):
                    self._become_ready()
                elif time.monotonic() - replicas_ready_at > FRONT_READY_S:
                    return Failure(f"the front did not answer within {FRONT_READY_S:g} s of its replicas' "
                                   f"readiness: {self.front.last_error()} (logs: {self.spec.log_dir})", [])
            reap_orphans(self._own_children())
            time.sleep(POLL_S)
        return None

    def check(self, replica: Replica) -> bool:
        """Follow one replica: rotation in and out of the front, restarts; True when its status changed."""
        before = replica.status
        if replica.status == "failed":
            return False
        if replica.popen is None:
            if time.monotonic() >= replica.restart_at and self.signals.stop is None:
                replica.restarts += 1
                log.info("replica %d: starting again (restart %d)", replica.index, replica.restarts)
                replica.start()
            return replica.status != before
        code = replica.popen.poll()
        if code is None:
            reported = replica.reported()
            if reported == "ready" and replica.status == "starting":
                replica.status, replica.failures_in_a_row = "ready", 0
                log.info("replica %d: ready", replica.index)
            elif reported == "stopping" and replica.status != "stopping":
                replica.status = "stopping"
            self.front.set_health(replica.index, replica.status == "ready")
            return replica.status != before
        self.front.set_health(replica.index, False)
        self._ended(replica, code)
        return True

    def _ended(self, replica: Replica, code: int) -> None:
        replica.popen = None
        replica.reason = supervisor_error(replica.log_path) or f"its supervisor exited with status {code}"
        if replica.status not in ("ready", "stopping"):  # it never got ready
            replica.failures_in_a_row += 1
        if replica.failures_in_a_row >= MAX_START_FAILURES:
            replica.status = "failed"
            log.error("replica %d: failed %d times in a row before getting ready; given up: %s", replica.index,
                      replica.failures_in_a_row, replica.reason)
            return
        delay = RESTART_DELAY_S * 2 ** replica.failures_in_a_row
        replica.status, replica.restart_at = "restarting", time.monotonic() + delay
        log.warning("replica %d ended (%s); starting it again in %g s", replica.index, replica.reason, delay)

    def _replicas_settled(self) -> bool:
        statuses = [r.status for r in self.replicas]
        return "ready" in statuses and all(s in ("ready", "failed") for s in statuses)

    def _become_ready(self) -> None:
        self.ready = True
        self.write_state("ready")
        given_up = [r for r in self.replicas if r.status == "failed"]
        for replica in given_up:
            log.warning("serving without replica %d: %s", replica.index, replica.reason)
        if not self.spec.detached:
            announce(self.launch.read() or {})

    # --- state -----------------------------------------------------------------------------------------

    def write_state(self, status: str) -> None:
        front = self.spec.front
        self.launch.write({
            "repo": self.spec.repo, "pid": os.getpid(), "status": status, "host": front.host,
            "world_size": self.spec.replicas[0].world_size, "ports": front.ports(), "urls": front.urls(),
            "log_dir": self.spec.log_dir, "detached": self.spec.detached, "stop_wait_s": self.spec.stop_wait_s,
            "front_marker": str(self.front.config_path),
            "front_pid": self.front.popen.pid if self.front.popen else None,
            "replicas": [replica.row() for replica in self.replicas]})

    # --- stopping --------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """The front stops taking connections; every replica stops as a launch does; then the front goes."""
        self.front.drain()
        running = [r for r in self.replicas if r.popen is not None and r.popen.poll() is None]
        for replica in running:
            replica.popen.send_signal(signal.SIGTERM)
        limit_s = max((replica.spec.stop_wait_s for replica in running), default=0.0)
        deadline = time.monotonic() + limit_s
        for replica in running:
            try:
                replica.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("replica %d's supervisor did not stop within %g s; killing it", replica.index, limit_s)
                replica.popen.kill()
                replica.popen.wait()
            self._clean(replica)
        self.front.stop(STOP_MARGIN_S)  # the replicas have stopped: nothing is left for it to carry
        reap_orphans(set())

    def _forward_hurry(self) -> None:
        """A second stop signal: the replicas' supervisors skip their grace periods too."""
        for replica in self.replicas:
            if replica.popen is not None and replica.popen.poll() is None:
                replica.popen.send_signal(signal.SIGTERM)

    @staticmethod
    def _clean(replica: Replica) -> None:
        """What a killed supervisor left of its replica (its state, processes, shared memory)."""
        lock = replica.folder.try_lock()
        if lock is not None:
            try:
                if replica.folder.state_file.exists():
                    clean_stale(replica.folder)
            finally:
                lock.close()

    def _own_children(self) -> set[int]:
        popens = [self.front.popen, *(r.popen for r in self.replicas)]
        return {p.pid for p in popens if p is not None}


if __name__ == "__main__":
    run_detached(FleetSpec.load, Fleet)
