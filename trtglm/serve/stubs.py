"""The processes below each rank's tritonserver, watched: its python-backend stubs and the engine processes
that the `tensorrt_llm` stubs start (backend/engine_process.py). Which of them died, on any rank.

A death is a process that nobody reaped: Triton 2.51 never waits for a python stub that died (it stays a
zombie for as long as its model is loaded) and neither restarts it nor ends the requests that were in it,
while /v2/health/ready and the model's readiness stay 200; a stub whose engine process died ends itself
(exit 1) and so becomes such a zombie too. A stub that Triton stops (an unload, a reload that replaces it)
is reaped at once, and an engine process by its stub, so a process that is a zombie for ZOMBIE_S died.

What the supervisor does then (supervise.py) is to stop the whole launch at once: no death below a rank
can be healed cleanly in Triton 2.51 (docs/troubleshooting.md, "A process of the launch died"):
- a request inside a dead stub never ends, not even when its model is loaded again; only the server's end
  ends it (a closed connection), and a stub that holds streams (`tensorrt_llm`, `tensorrt_llm_bls`, and
  the engine behind them) always has requests in it;
- unloading and loading a model again leaves a window in which its ensemble "has no available versions",
  and the reloaded model's other, live stubs behind with the old model; loading it in place keeps health
  at 200 until the new stub runs;
- with several ranks, every rank's engine takes part in every step: one rank's loss stops them all.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil

from trtglm.backend.contract import STUB
from trtglm.serve.exits import ExitWaiter

CHILDREN_FILES = Path(f"/proc/self/task/{threading.get_native_id()}/children").exists()  # Linux, CONFIG_PROC_CHILDREN
ZOMBIE_S = 0.05  # a stub or engine process unreaped this long died (Triton and the stubs reap theirs at once)
SCAN_S = 1.0  # how often the process trees are listed for new processes (DeathWatch)
ENGINE_MODULE = "trtglm.backend.engine_process"


def is_stub(args: list[str]) -> bool:
    return len(args) > 8 and os.path.basename(args[0]) == STUB


def stub_model(args: list[str]) -> str:
    """The model a stub runs (argv: model.py as REPO/MODEL/VERSION/model.py, shm region, sizes, parent pid,
    lib dir, ipc handle, instance name, model dir)."""
    return Path(args[1]).parent.parent.name


def role(args: list[str]) -> str | None:
    """What a process below a tritonserver is: a model instance's stub, an engine process, or None."""
    if is_stub(args):
        return f"{stub_model(args)}'s python stub ({args[8]})"
    if ENGINE_MODULE in args:
        return "tensorrt_llm's engine process"
    return None


def child_pids(pid: int) -> list[int]:
    """`pid`'s children, read from /proc/PID/task/*/children: a few small files, where psutil's children() reads
    every process's stat (slow on a busy machine, and the watch lists the trees every SCAN_S)."""
    if not CHILDREN_FILES:
        try:
            return [child.pid for child in psutil.Process(pid).children()]
        except psutil.Error:
            return []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone (or going) while being looked at
        return []
    pids = []
    for thread in threads:
        try:
            pids += [int(child) for child in Path(f"/proc/{pid}/task/{thread}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in child_pids(parent)]
        found += frontier
    return found


def is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("Z")  # the state follows the command name in parentheses


class DeathWatch:
    """The stubs and engine processes of every rank, and the first of them that died.

    A thread of its own lists the ranks' process trees every SCAN_S (a tritonserver has hundreds of threads, each
    with a children file: on a busy machine a listing takes up to half a second), so that new processes get known
    and watched; the watching thread only looks at the known processes that exited, and so acts within moments."""

    def __init__(self, ranks: dict[int, psutil.Process]):
        self.ranks = ranks  # rank → its tritonserver (the caller's, which may grow)
        self.roles: dict[int, tuple[int, str]] = {}  # pid → (rank, role): a zombie's command line cannot be read
        self.zombie_since: dict[int, float] = {}
        self.exits = ExitWaiter()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.lister = threading.Thread(target=self._list_every, name="process-trees", daemon=True)

    def start(self) -> DeathWatch:
        """List the trees once (every process known by its role before anyone can kill one), then every SCAN_S."""
        self.scan()
        self.lister.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.exits.close()

    def wait(self, timeout_s: float, more_pids=()) -> None:
        """Sleep up to timeout_s, less when one of the known stubs and engine processes or `more_pids` exits: then
        until that one has been a zombie for ZOMBIE_S, timed from its exit."""
        with self.lock:
            known = list(self.roles)
        self.exits.watch([*known, *more_pids])
        exited = self.exits.wait(timeout_s)
        if exited:
            now = time.monotonic()
            with self.lock:
                self.zombie_since.update({pid: now for pid in exited if pid not in self.zombie_since})
            time.sleep(ZOMBIE_S)

    def died(self, after_s: float = ZOMBIE_S) -> tuple[int, str] | None:
        """(rank, "rank R's ROLE (pid P)") of a known process that has been a zombie for after_s, or None."""
        now = time.monotonic()
        with self.lock:
            self.zombie_since = {pid: since for pid, since in self.zombie_since.items()
                                 if pid in self.roles and is_zombie(pid)}  # not a stub that Triton reaped
            dead = sorted(pid for pid, since in self.zombie_since.items() if now - since >= after_s)
            if not dead:
                return None
            rank, what = self.roles[dead[0]]
        return rank, f"rank {rank}'s {what} (pid {dead[0]})"

    def scan(self) -> None:
        """Learn the processes below each rank, and which of them are zombies already."""
        now, roles, zombies = time.monotonic(), {}, set()
        for rank, server in list(self.ranks.items()):
            for pid in descendants(server.pid):
                if is_zombie(pid):
                    zombies.add(pid)
                    roles[pid] = self.roles.get(pid, (rank, f"process {pid}"))
                else:
                    roles[pid] = self.roles.get(pid) or (rank, describe(pid))
        with self.lock:
            self.roles = roles  # those no longer listed are gone: pids are reused
            self.zombie_since.update({pid: now for pid in zombies if pid not in self.zombie_since})

    def _list_every(self) -> None:
        while not self.stopped.wait(SCAN_S):
            self.scan()


def describe(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return role(proc.cmdline()) or repr(proc.name())
    except psutil.Error:
        return f"process {pid}"
