"""The serving benchmark from scratch: build the tiny fixture's engine, render its repository,
launch it on free loopback ports, run `trtglm bench serving` against it, stop it.

    trtglm bench serving-local [--work-dir /tmp/trtglm-bench-serving] [--config configs/tiny.yaml]
                               [--out DIR] [-- FLAGS FOR `trtglm bench serving`]

Prints the markdown tables (the serving section of docs/benchmarks.md) and, with --out,
writes serving.json and serving.md there.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from trtglm.errors import TrtglmError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trtglm(*args: str, env: dict) -> None:
    """Run `trtglm ARGS`; a failure (which printed its own error) ends the benchmark with its status."""
    done = subprocess.run([sys.executable, "-m", "trtglm", *args], env=env)
    if done.returncode != 0:
        error = TrtglmError(f"`trtglm {args[0]}` failed (status {done.returncode})")
        error.exit_code = done.returncode
        raise error


def run(work_dir: str, config: str, out: str | None, bench_flags: list[str]) -> None:
    work = Path(work_dir).resolve()
    engine, repo = work / "engine", work / "repo"
    env = {**os.environ, "TRTGLM_STATE_DIR": str(work / "state"), "PYTHONUNBUFFERED": "1"}
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    trtglm("build-engine", "--config", config, "--output-dir", str(engine), "--force", env=env)
    trtglm("patch-repo", "--engine-dir", str(engine), "--output-repo", str(repo), "--force", env=env)
    trtglm("launch", "--repo", str(repo), "--detach", "--no-openai",
           *(f"--{name}-port={port}" for name, port in ports.items()), env=env)
    try:
        out_flags = ["--out", str(Path(out).resolve())] if out else []
        trtglm("bench", "serving", "--url", f"http://127.0.0.1:{ports['http']}", *out_flags, *bench_flags, env=env)
    finally:
        trtglm("stop", "--repo", str(repo), env=env)

