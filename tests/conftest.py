"""Shared test helpers: the fixture model's location and a way to run the real CLI."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "tiny-chatglm3"
SHARED = REPO.parent / "shared"


def run_cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `trtglm ARGS` in a subprocess, as a user would; returns the completed process."""
    proc = subprocess.run([sys.executable, "-m", "trtglm", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"trtglm {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc



def free_ports(count: int = 3) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago, below the kernel's ephemeral range: the
    ephemeral ports that mpirun, gloo and clients bind meanwhile can never take them."""
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = random.sample(range(max(1024, low - 12000), low), 200)
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports below {low}")


def repo_processes(repo: Path) -> list[psutil.Process]:
    """Processes (mpirun, tritonserver, python stubs, a launch) whose command line names `repo`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and any(str(repo) in arg for arg in proc.info["cmdline"] or ()) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_repo_processes(repo: Path) -> None:
    """Kill whatever still runs for `repo` (cleanup after a failed test) and wait for it."""
    leftovers = repo_processes(repo)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(leftovers, timeout=10)


# Kinds of fixture conversation that end-to-end tests serve (the first of each kind).
CONVERSATION_KINDS = {
    "english": lambda c: c["answer"].isascii() and len(c["messages"]) == 1,
    "multi-line answer": lambda c: "\n" in c["answer"],
    "rare Chinese (byte pieces)": lambda c: any(ch in c["answer"] for ch in "淼犇鑫焱垚"),
    "Chinese": lambda c: "的" in c["answer"],
    "history": lambda c: len(c["messages"]) > 2 and c["messages"][0]["role"] == "user",
    "system message": lambda c: c["messages"][0]["role"] == "system" and len(c["messages"]) == 2,
    "tool call and observation": lambda c: any(m["role"] == "observation" for m in c["messages"]),
}


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    if not (FIXTURE / "config.json").exists():
        pytest.fail(f"fixture model missing at {FIXTURE}; run scripts/train_fixture.py")
    return FIXTURE


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test models are tiny: one thread beats two contending threads on a 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
