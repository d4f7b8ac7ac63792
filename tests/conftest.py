"""Shared test helpers: the fixture model's location and a way to run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    if not (FIXTURE / "config.json").exists():
        pytest.fail(f"fixture model missing at {FIXTURE}; run scripts/train_fixture.py")
    return FIXTURE
