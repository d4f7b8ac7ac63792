#!/usr/bin/env python3
"""The serving benchmark from scratch: build the tiny fixture's engine, render its repository,
launch it on free loopback ports, run `trtglm bench serving` against it, stop it.

    python scripts/bench_serving.py [--work-dir /tmp/trtglm-bench-serving] [--config configs/tiny.yaml]
                                    [--out DIR] [-- FLAGS FOR `trtglm bench serving`]

Prints the markdown tables (the serving section of docs/benchmarks.md) and, with --out,
writes serving.json and serving.md there.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trtglm(*args: str, env: dict) -> None:
    """Run `trtglm ARGS`; a failure (which printed its own error) ends this script with its status."""
    done = subprocess.run([sys.executable, "-m", "trtglm", *args], cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(done.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/trtglm-bench-serving"))
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--out", type=Path)
    parser.add_argument("bench_flags", nargs="*", help="passed on to `trtglm bench serving` (after --)")
    options = parser.parse_args()

    work = options.work_dir.resolve()
    engine, repo = work / "engine", work / "repo"
    env = {**os.environ, "TRTGLM_STATE_DIR": str(work / "state"), "PYTHONUNBUFFERED": "1"}
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    trtglm("build-engine", "--config", options.config, "--output-dir", str(engine), "--force", env=env)
    trtglm("patch-repo", "--engine-dir", str(engine), "--output-repo", str(repo), "--force", env=env)
    trtglm("launch", "--repo", str(repo), "--detach", *(f"--{name}-port={port}" for name, port in ports.items()),
           env=env)
    try:
        out = ["--out", str(options.out.resolve())] if options.out else []
        trtglm("bench", "serving", "--url", f"http://127.0.0.1:{ports['http']}", *out, *options.bench_flags, env=env)
    finally:
        trtglm("stop", "--repo", str(repo), env=env)


if __name__ == "__main__":
    main()
