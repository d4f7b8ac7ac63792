"""The supervisor: starts the servers, waits for rank 0, watches every rank, stops them all.

One process supervises one launch for its whole life: `trtglm launch` itself in the foreground, or with
`--detach` a daemon (`python -m trtglm.serve.supervise SPEC`, its own session, output in LOGS/supervisor.log)
that `launch` waits for until it reports ready. It holds the launch folder's lock (state.py) and owns the server
command (mpirun, or tritonserver for one rank), in a session of its own so that Ctrl-C reaches only the supervisor.

Watching: every 0.1 s, and at once when a watched process exits (exits.py), the supervisor looks at the processes
it knows; a thread lists each rank's process tree every second (stubs.py: python stubs are a rank's children,
engine processes the `tensorrt_llm` stubs'; ranks are told apart by the shm prefix in their command line). If
mpirun exits, any rank disappears, a python stub or engine process of any rank dies (stubs.py: Triton 2.51
neither notices nor heals that), or a rank's tritonserver reports a fatal signal (it can hang in its crash
handler: rank_logs.FATAL_SIGNAL), everything is stopped at once, the tail of that rank's log is printed and the
launch fails: the ranks first, given DEATH_GRACE_S after their SIGTERM, so that every request in flight has its
error (or its closed connection) within a few seconds and health stops answering 200, then the OpenAI API,
which passes those errors on to its clients. A deployment's orchestrator starts the launch again. SIGINT,
SIGTERM or SIGHUP stop everything and end the launch normally; a second signal skips the grace period. The
supervisor is its launch's subreaper: a process orphaned below it (a killed stub's engine process, a killed
rank's stubs) becomes its child, and it reaps every such child that ends, so that no zombie is left.

Ready means: rank 0 answers /v2/health/ready, every rank's process runs, and `ensemble`,
`tensorrt_llm_bls` and the history model `chatglm3-6b` (those the repository has) each answered one
real request (a short prompt, a few tokens; the history model's inputs as its config declares them):
a server whose models load but cannot answer fails the launch, naming the model and the last error
its log holds. With NVIDIA's
backend, rank 0's tensorrt_llm is ready only once every rank holds the engine; python models
on ranks > 0 load independently, so one that fails after rank 0 is ready is caught by the
watch (with --detach: after `launch` has returned).

Stopping: SIGTERM goes to each rank's tritonserver (not to mpirun, which would exit at once and leave its ranks
behind; Open MPI also gives each rank a process group of its own; other hosts' ranks: hosts.py). It unloads its
models, its stubs exit and remove their shared memory, and mpirun exits when its ranks have. What still runs after
the grace period (`launch --drain`, and 5 s) is killed; shared memory with the launch's prefix is removed.

The OpenAI-compatible API (openai_process.py), when the launch serves it, starts once the
checks have passed and answers before the launch reports ready; if it dies, everything is stopped
as when a rank dies, its log's tail printed. It is stopped first.

What to launch comes as a `LaunchSpec` (launch_spec.py); the ranks' logs are read by rank_logs.py, the first
requests are first_requests.py's, the reaping of orphans reaping.py's.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import psutil
from tqdm import tqdm

from trtglm.backend.cpus import engine_cpus_env
from trtglm.client import NO_PROXY
from trtglm.errors import TrtglmError
from trtglm.files import PHASE_FILE, read_phase
from trtglm.processes import alive
from trtglm.serve.launch_spec import LaunchSpec
from trtglm.serve.openai_process import OpenAIProcess
from trtglm.serve.rank_logs import (FatalSignals, first_abort, last_error_line, print_excerpt, print_tails, rank_death,
                                    read_log)
from trtglm.serve.signals import SignalFlags
from trtglm.serve.first_requests import first_requests
from trtglm.serve.reaping import become_subreaper, reap_orphans
from trtglm.serve.state import LaunchDir, kill, processes_with, remove_shm, shm_files
from trtglm.serve.status import announce
from trtglm.serve.stubs import DeathWatch, descendants
from trtglm.serve.tritonserver import server_env

log = logging.getLogger(__name__)

DEATH_GRACE_S = 0.5  # the same once a process of the launch died: requests the death stranded end with the server
POLL_S = 0.1  # the watch wakes this often, and at once when a watched process exits


@dataclass
class Failure:
    message: str
    ranks: list[int]  # whose logs to show
    logs: tuple[Path, ...] = ()  # other logs to show


class Supervisor:
    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.launch = LaunchDir(Path(spec.launch_dir))
        self.log_dir = Path(spec.log_dir)
        self.popen: subprocess.Popen | None = None
        self.root: psutil.Process | None = None
        self.tracked: dict[int, psutil.Process] = {}
        self.ranks: dict[int, psutil.Process] = {}
        self.signals = SignalFlags()
        self.openai = (OpenAIProcess(spec.repo, spec.endpoints, spec.shm_base, self.log_dir, spec.drain_s)
                       if spec.endpoints.openai_port is not None else None)

    # --- the whole life --------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped by a signal (returns) or until a rank dies or never gets ready (TrtglmError)."""
        previous = self.signals.install()
        become_subreaper()
        failure = None
        try:
            failure = self._serve()
        finally:
            if failure is not None:  # health stops answering 200 at once; the orderly rest of the stop follows
                for proc in self.ranks.values():
                    _terminate(proc)
            self.mark_stopping()
            self.shutdown(failed=failure is not None)
            self.launch.state_file.unlink(missing_ok=True)
            self.signals.restore(previous)
        if failure is not None:
            print_tails(self.log_dir, failure.ranks)
            for path in failure.logs:
                print_excerpt(path)
            raise TrtglmError(failure.message)
        if self.signals.stop is not None:
            log.info("%s: stopped (%s)", self.spec.repo, signal.Signals(self.signals.stop).name)

    def _serve(self) -> Failure | None:
        self.start()
        failure = self.wait_ready()
        if failure is None and self.signals.stop is None:
            failure = self.check_answers()
        if failure is None and self.signals.stop is None:
            failure = self.start_openai()
        if failure is not None or self.signals.stop is not None:
            return failure
        deaths = DeathWatch(self.ranks).start()
        self.write_state("ready")
        if not self.spec.detached:
            announce(self.launch.read() or {})
        try:
            return self.watch(deaths)
        finally:
            deaths.stop()

    # --- starting ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._reset_logs()
        env = self.spec.rank_env(server_env({**os.environ, **self.spec.environment}, self.spec.launch_id,
                                            self.spec.python_bin))
        if self.spec.cpus is not None:
            os.sched_setaffinity(0, self.spec.cpus)
        self.launch.phase_file.unlink(missing_ok=True)
        env[PHASE_FILE] = str(self.launch.phase_file)
        engine_env, server_cpus = engine_cpus_env(self.spec.world_size, env)
        env.update(engine_env)
        env.update(self.spec.preload_vars(env))
        if server_cpus:  # this process's children (the server, its stubs, the OpenAI API) inherit them
            os.sched_setaffinity(0, server_cpus)
        argv = self.spec.command(env)
        log.debug("server command: %s", shlex.join(argv))
        if self.spec.world_size == 1:
            rank_dir = self.log_dir / "ranks" / "rank.0"
            rank_dir.mkdir(parents=True)
            outputs = (open(rank_dir / "stdout", "wb"), open(rank_dir / "stderr", "wb"))
        else:
            mpirun_log = open(self.log_dir / "mpirun.log", "wb")
            outputs = (mpirun_log, mpirun_log)
        try:
            self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=outputs[0],
                                          stderr=outputs[1], start_new_session=True)
        finally:
            for handle in set(outputs):
                handle.close()
        self.root = psutil.Process(self.popen.pid)
        self.write_state("starting", command=argv)

    def _reset_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.log_dir / "ranks", ignore_errors=True)
        (self.log_dir / "mpirun.log").unlink(missing_ok=True)

    def write_state(self, status: str, **extra) -> None:
        state = self.launch.read() if status != "starting" else None
        state = state or {
            "repo": self.spec.repo, "pid": os.getpid(), "server_pid": self.popen.pid, "launch_id": self.spec.launch_id,
            "shm_base": self.spec.shm_base, "world_size": self.spec.world_size, "host": self.spec.endpoints.host,
            "ports": self.spec.endpoints.ports(), "urls": self.spec.endpoints.urls(), "log_dir": str(self.log_dir),
            "detached": self.spec.detached, "started": time.time(), "api_key": self.spec.api_key,
            "cuda_visible_devices": {**os.environ, **self.spec.environment}.get("CUDA_VISIBLE_DEVICES"),
            "stop_wait_s": self.spec.stop_wait_s, "hosts": self.spec.hosts and [h.host for h in self.spec.hosts]}
        self.launch.write({**state, **extra, "status": status})

    def mark_stopping(self) -> None:
        """Say so in the state (a front takes the launch out of its rotation at once) and to the OpenAI API (its
        /health stops answering 200) before stopping."""
        if self.openai is not None:
            self.openai.not_ready()
        state = self.launch.read()
        if state is not None:
            self.launch.write({**state, "status": "stopping"})

    def wait_ready(self) -> Failure | None:
        """None once rank 0 answers ready and every rank runs; a Failure on death or timeout."""
        started = time.monotonic()
        url = self.spec.endpoints.urls()["http"] + "/v2/health/ready"
        with tqdm(total=round(self.spec.timeout_s), desc="starting tritonserver", unit="s", disable=None,
                  bar_format="{desc}: {elapsed}") as bar:
            while time.monotonic() - started < self.spec.timeout_s:
                if self.signals.stop is not None:
                    return None
                failure = self.check_ranks()
                if failure is not None:
                    return failure
                if len(self.ranks) >= self.spec.watched_ranks and answers_ok(url):
                    log.info("%s: ready after %.1f s", self.spec.repo, time.monotonic() - started)
                    return None
                time.sleep(POLL_S)
                show_phase(bar, self.launch.phase_file, started)
        return Failure(f"rank 0 was not ready within {self.spec.timeout_s:g} s; stopped all ranks "
                       f"(logs: {self.log_dir})", list(range(self.spec.world_size)))

    def check_answers(self) -> Failure | None:
        """One real request through each model clients ask that the repository has (first_requests), so that
        a server whose models cannot answer is never called ready."""
        from trtglm.client import ServerError

        url = self.spec.endpoints.urls()["http"]
        for model, ask in first_requests(Path(self.spec.repo)):
            started = time.monotonic()
            try:
                ask(url)
            except ServerError as e:
                cause = first_abort(self.log_dir, 0) or last_error_line(self.log_dir, 0)
                return Failure(f"{model} failed its first request at launch ({e})"
                               f"{f'; rank 0 logged: {cause}' if cause else ''}; stopped all ranks "
                               f"(logs: {self.log_dir})", [0])
            log.info("%s answered a first request in %.2f s", model, time.monotonic() - started)
        return None

    def start_openai(self) -> Failure | None:
        """Start the OpenAI-compatible API (if served) and wait until it answers."""
        if self.openai is None:
            return None
        self.openai.start(dict(os.environ))
        self.launch.write({**(self.launch.read() or {}), "openai_pid": self.openai.popen.pid})
        problem = self.openai.wait_ready(lambda: self.signals.stop is not None or self.check_ranks() is not None,
                                         answers_ok)
        if problem is None:
            return self.check_ranks()
        return Failure(f"{problem}; stopped all ranks (logs: {self.log_dir})", [], (self.openai.log_path,))

    # --- watching ---------------------------------------------------------------------------------

    def watch(self, deaths: DeathWatch) -> Failure | None:
        signals = FatalSignals(self.log_dir)
        while self.signals.stop is None:
            failure = (self.check_ranks() or self.check_crashes(signals, deaths) or self.check_openai()
                       or self.check_deaths(deaths))
            if failure is not None:
                return failure
            reap_orphans(self._own_children())
            deaths.wait(POLL_S, [*self._own_children(), *(proc.pid for proc in self.ranks.values())])
        return None

    def check_openai(self) -> Failure | None:
        if self.openai is None or not self.openai.died():
            return None
        return Failure(f"the OpenAI API (pid {self.openai.popen.pid}) exited with status "
                       f"{self.openai.popen.returncode}; stopped all ranks (logs: {self.log_dir})", [],
                       (self.openai.log_path,))

    def check_deaths(self, deaths: DeathWatch) -> Failure | None:
        """A Failure when a python stub or engine process of any rank died (stubs.py)."""
        dead = deaths.died()
        if dead is None:
            return None
        rank, what = dead
        log.error("%s died; stopping the launch", what)
        return Failure(f"{what} died; stopped all ranks (logs: {self.log_dir})", [rank])

    def check_crashes(self, signals: FatalSignals, deaths: DeathWatch) -> Failure | None:
        """A Failure once a rank's tritonserver reported a fatal signal: it is dying, or hung in its crash
        handler (rank_logs.FATAL_SIGNAL), and must not be left holding its clients. A stub or engine process
        already dead is named as the cause: Triton 2.51's python backend can abort on a stub's death."""
        crashed = signals.first()
        if crashed is None:
            return None
        rank, name = crashed[0], signal.Signals(crashed[1]).name
        dead = deaths.died(after_s=0)
        after = f" after {dead[1]} died" if dead else ""
        log.error("rank %d's tritonserver received %s%s; stopping the launch", rank, name, after)
        return Failure(f"rank {rank}'s tritonserver crashed ({name}){after}; stopped all ranks "
                       f"(logs: {self.log_dir})", [rank])

    def check_ranks(self) -> Failure | None:
        if len(self.ranks) < self.spec.watched_ranks:  # then the stubs' watch lists the trees (stubs.py)
            self.refresh()
        rank = self._dead()
        if rank is None:
            return None
        rank, what = rank_death(self.log_dir, rank, self.spec.world_size)  # a rank agent's words first (hosts.py)
        return Failure(f"{what}; stopped all ranks (logs: {self.log_dir})", [rank])

    def refresh(self) -> None:
        """Track the command's process tree; learn each rank's process."""
        new = []
        for pid in descendants(self.root.pid):
            if pid not in self.tracked:
                try:
                    self.tracked[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
                new.append(self.tracked[pid])
        if self.spec.world_size == 1:
            self.ranks[0] = self.root
            return
        for proc in new:
            rank = self._rank_of(proc)
            if rank is not None:
                self.ranks.setdefault(rank, proc)

    def _rank_of(self, proc: psutil.Process) -> int | None:
        flag = f"--backend-config=python,shm-region-prefix-name={self.spec.shm_base}"
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            return None
        for arg in cmdline:
            if arg.startswith(flag):
                return int(arg[len(flag):].rstrip("_"))
        return None

    def _dead(self) -> int | None:
        """The rank that died first, if one did."""
        code = self.popen.poll()
        if self.spec.world_size == 1:
            return 0 if code is not None else None
        for rank, proc in sorted(self.ranks.items()):
            if not alive(proc):
                return rank
        if code is not None:  # mpirun ended before every rank was seen
            reported = self._mpirun_rank()
            unseen = [r for r in range(self.spec.world_size) if r not in self.ranks]
            return reported if reported is not None else (unseen or [0])[0]
        return None

    def _mpirun_rank(self) -> int | None:
        match = re.search(r"process rank (\d+)", read_log(self.log_dir / "mpirun.log"))
        return int(match.group(1)) if match else None

    # --- stopping ---------------------------------------------------------------------------------

    def shutdown(self, failed: bool = False) -> None:
        """Stop the ranks and the OpenAI API, reap what they leave, remove leftover shared memory. An orderly stop
        gives the spec's grace_s and stops the API first (its requests end while the ranks still serve them); after a
        failure (a death) the ranks go first, given DEATH_GRACE_S, and the API passes their requests' errors on
        before it goes; a second signal gives no grace at all."""
        orderly = not (failed or self.signals.hurry)
        grace_s = self.spec.grace_s if orderly else 0.0 if self.signals.hurry else DEATH_GRACE_S
        if self.openai is not None and orderly:
            self.openai.stop(grace_s)
        self._stop_ranks(grace_s, orderly)
        if self.openai is not None:
            self.openai.stop(grace_s)
        reap_orphans(self._own_children())

    def _stop_ranks(self, grace_s: float, orderly: bool) -> None:
        """SIGTERM every rank, wait up to `grace_s`, SIGKILL what is left, remove leftover shared memory."""
        if self.popen is None:
            return
        self.refresh()
        ranks = [proc for proc in self.ranks.values() if alive(proc)]
        for proc in ranks:
            _terminate(proc)
        self.spec.stop_other_hosts(self.popen)
        if not ranks and self.popen.poll() is None:
            self.popen.terminate()
        self._wait(lambda: self.popen.poll() is None or any(map(alive, self.tracked.values())), grace_s)
        if self.popen.poll() is None and orderly:  # after a failure, no more waiting
            self.popen.terminate()
            self._wait(lambda: self.popen.poll() is None, 3.0)
        leftovers = [p for p in [*ranks, *self.tracked.values()] if alive(p)]
        if leftovers:
            log.warning("killing %d process(es) %s", len(leftovers),
                        "(second signal)" if self.signals.hurry else f"that did not stop within {grace_s:g} s")
        kill(leftovers)
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        kill(processes_with(self.spec.shm_base))  # any the tree lost (listing every process is slow: last)
        remove_shm(self.spec.shm_base)

    def _own_children(self) -> set[int]:
        """The children this process's Popen objects wait for themselves."""
        return {p.pid for p in (self.popen, self.openai and self.openai.popen) if p is not None}

    def _wait(self, busy, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while busy() and time.monotonic() < deadline and not self.signals.hurry:
            time.sleep(0.1)


def _terminate(proc: psutil.Process) -> None:
    try:
        proc.terminate()
    except psutil.Error:
        pass


def show_phase(bar: tqdm, phase_file: Path, started: float) -> None:
    """The waiting bar: time since the launch started, and the engine's phase with its time so far."""
    phase = read_phase(phase_file)
    bar.set_description_str(f"starting tritonserver: {phase[0]} ({phase[1]:.0f} s)" if phase else
                             "starting tritonserver", refresh=False)
    bar.update(round(time.monotonic() - started) - bar.n)


def answers_ok(url: str) -> bool:
    try:
        with NO_PROXY.open(url, timeout=1) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_detached(load, runner, argv: list[str] | None = None) -> None:
    """A detached supervisor's (or fleet's) life: `python -m MODULE SPEC.json`, its spec read by `load`, run by
    `runner`, its error the last line of its log."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load(Path(argv[0]))
    try:
        runner(spec).run()
    except TrtglmError as e:
        print(f"trtglm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    run_detached(LaunchSpec.load, Supervisor)
