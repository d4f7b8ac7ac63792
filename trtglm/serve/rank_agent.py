"""A rank's agent on its host, for launches over several hosts (hosts.py): mpirun starts
`python -m trtglm.serve.rank_agent --log-dir DIR --drain S -- TRITONSERVER ARGS…` as the rank's process.

The agent runs the rank's tritonserver in a session of its own (mpirun signals the agent's process group; the
server dies with the agent), with the library that launches preload built on this host (preload.py), its stdout
and stderr in DIR/ranks/rank.N/ on this host, and the rank's state there too (agent.json: host, pids, status, why
it ended). It watches the server as the supervisor watches ranks on one host: the server's exit, its python stubs
and engine process (stubs.py: deaths Triton 2.51 does not notice), a fatal signal its log reports
(rank_logs.FATAL_SIGNAL). On any of them it kills the server, says why on its stderr with the log's last lines
(mpirun brings them to the launch's mpirun.log) and exits 1: mpirun then ends the whole job, and the supervisor
stops the launch. SIGUSR1 (an orderly stop, passed on by mpirun to every rank), SIGTERM, SIGINT or SIGHUP stop the
server with the launch's drain; a second signal kills it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from trtglm.engine.manifest import write_json_atomic
from trtglm.processes import alive
from trtglm.serve.hosts import STOP_SIGNAL
from trtglm.serve.launch_spec import STOP_MARGIN_S
from trtglm.serve.preload import preload_library
from trtglm.serve.rank_logs import FATAL_SIGNAL, LogTail, agent_report, log_excerpt, read_log
from trtglm.serve.reaping import become_subreaper, reap_orphans
from trtglm.serve.state import remove_shm
from trtglm.serve.stubs import DeathWatch
from trtglm.serve.tritonserver import preload_cache_dir

POLL_S = 0.2
STOP_SIGNALS = (STOP_SIGNAL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SHM_FLAG = "--backend-config=python,shm-region-prefix-name="
PR_SET_PDEATHSIG = 1  # prctl(2)


def this_rank() -> int:
    """This process's rank, from Open MPI's (or PMIx's) environment."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK") or 0)


def die_with_parent() -> None:
    """In the server's process before it runs: killed when the agent goes, however it goes."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class RankAgent:
    def __init__(self, server_argv: list[str], log_dir: Path, drain_s: float):
        self.argv, self.drain_s = server_argv, drain_s
        self.rank, self.host = this_rank(), socket.gethostname()
        self.folder = Path(log_dir) / "ranks" / f"rank.{self.rank}"
        self.shm_prefix = next((arg[len(SHM_FLAG):] for arg in server_argv if arg.startswith(SHM_FLAG)), None)
        self.server: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.hurry = False

    def run(self) -> int:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        become_subreaper()
        self.start()
        why = self.watch()
        if why is None:
            self.stop(self.drain_s + STOP_MARGIN_S)
            self.write_state("stopped", f"{signal.Signals(self.stop_signal).name}")
            return 0
        print(agent_report(self.rank, self.host, why, self.folder),
              *(f"trtglm rank {self.rank}: {line}" for line in log_excerpt(read_log(self.folder / "stderr"), 20)),
              sep="\n", file=sys.stderr, flush=True)
        self.stop(0.0)
        self.write_state("failed", why)
        return 1

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        library = preload_library(preload_cache_dir())  # this host's build: the launcher's path may not exist here
        others = [p for p in env.get("LD_PRELOAD", "").split(":") if p and Path(p).name != library.name]
        env["LD_PRELOAD"] = ":".join([str(library), *others])
        with open(self.folder / "stdout", "wb") as out, open(self.folder / "stderr", "wb") as err:
            self.server = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                           start_new_session=True, preexec_fn=die_with_parent)
        self.write_state("serving")

    def watch(self) -> str | None:
        """None once a stop was asked for; else why the rank must end."""
        deaths, tail = DeathWatch({self.rank: psutil.Process(self.server.pid)}).start(), LogTail(self.folder, "stderr")
        try:
            return self._watch(deaths, tail)
        finally:
            deaths.stop()

    def _watch(self, deaths: DeathWatch, tail: LogTail) -> str | None:
        while self.stop_signal is None:
            code = self.server.poll()
            if code is not None:
                return f"its tritonserver exited with status {code}"
            dead = deaths.died()
            if dead is not None:
                return f"{dead[1]} died"
            fatal = next((FATAL_SIGNAL.fullmatch(line) for _, line in tail.new_lines()
                          if FATAL_SIGNAL.fullmatch(line)), None)
            if fatal is not None:
                return f"its tritonserver crashed ({signal.Signals(int(fatal.group(1))).name})"
            reap_orphans({self.server.pid})
            deaths.wait(POLL_S, [self.server.pid])
        return None

    def stop(self, grace_s: float) -> None:
        """SIGTERM the server (it lets its requests finish, unloads, ends its stubs), SIGKILL its session after
        `grace_s` or at a second signal, then remove what it left in shared memory."""
        if self.server.poll() is None:
            self.server.terminate()
            deadline = time.monotonic() + grace_s
            while self.server.poll() is None and time.monotonic() < deadline and not self.hurry:
                time.sleep(0.1)
        try:
            os.killpg(self.server.pid, signal.SIGKILL)  # its session: the stubs and engine processes too
        except ProcessLookupError:
            pass
        self.server.wait()
        leftovers = [p for p in psutil.Process().children(recursive=True) if alive(p)]
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=5)
        reap_orphans(set())
        if self.shm_prefix:
            remove_shm(self.shm_prefix)

    def write_state(self, status: str, why: str | None = None) -> None:
        write_json_atomic(self.folder / "agent.json", {
            "rank": self.rank, "host": self.host, "pid": os.getpid(), "server_pid": self.server.pid,
            "status": status, "why": why, "time": time.time()})

    def _on_signal(self, signum: int, _frame) -> None:
        if self.stop_signal is not None:
            self.hurry = True
        else:
            self.stop_signal = signum


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: python -m trtglm.serve.rank_agent --log-dir DIR --drain S -- TRITONSERVER ARGS…")
    at = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m trtglm.serve.rank_agent")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--drain", type=float, required=True)
    args = parser.parse_args(argv[:at])
    sys.exit(RankAgent(argv[at + 1:], Path(args.log_dir), args.drain).run())


if __name__ == "__main__":
    main()
