"""The library preloaded into a launch's server processes (preload.c), and the environment that uses it.

What a local user must not get from a launch, and why tritonserver and Open MPI alone cannot promise it:
- the repository API's secret (command.py): tritonserver takes it only as a flag, and every user reads
  /proc/PID/cmdline; the library appends the flags in $TRTGLM_SERVER_ARGS to tritonserver's arguments, and a
  process's environment is readable by its own user alone;
- the python backend's shared memory (prompts and replies): Boost.Interprocess makes each segment 0644 whatever
  the umask, and a reader that opens it in the moment before a later chmod keeps its access; the library
  creates them 0600;
- mpirun's listeners: Open MPI 4's and 5's out-of-band listeners bind to every interface whatever the MCA
  settings; the library binds them to loopback (the ranks share one host, so nothing else connects to them).

It is compiled once per source version with the C compiler (`cc`, or $CC) into the cache folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from trtglm.errors import DependencyError

SOURCE = Path(__file__).with_name("preload.c")
ARGS_VAR = "TRTGLM_SERVER_ARGS"  # tritonserver's hidden flags, one a line
LOOPBACK_VAR = "TRTGLM_LOOPBACK_BINDS"  # set: processes other than tritonserver bind wildcards to loopback
PRELOAD_VARS = ("LD_PRELOAD", ARGS_VAR, LOOPBACK_VAR)  # what mpirun must pass to its ranks


def preload_library(cache_dir: Path, compiler: str | None = None) -> Path:
    """The compiled library for this source, built into `cache_dir` when missing."""
    source = SOURCE.read_bytes()
    library = cache_dir / hashlib.sha256(source).hexdigest()[:16] / "libtrtglm_preload.so"
    if library.is_file():
        return library
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise DependencyError("trtglm launch needs a C compiler (cc) once, to build the library that keeps its "
                              "secret off command lines: apt-get install gcc (or set $CC)")
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    built = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"], capture_output=True,
                           text=True)
    if built.returncode != 0:
        os.unlink(tmp)
        raise DependencyError(f"building {SOURCE.name} with {cc} failed: {built.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, library)  # atomic: a parallel launch sees the whole library or none
    return library


def preload_env(library: Path, hidden_args: Sequence[str], loopback_binds: bool,
                preloaded: str = "") -> dict[str, str]:
    """The variables that make the server processes load `library` (before what `preloaded`, the LD_PRELOAD
    inherited, names), with tritonserver's `hidden_args`."""
    if any("\n" in arg for arg in hidden_args):
        raise ValueError("a hidden tritonserver argument cannot hold a line break")
    env = {"LD_PRELOAD": ":".join(filter(None, (str(library), preloaded))), ARGS_VAR: "\n".join(hidden_args)}
    return {**env, LOOPBACK_VAR: "1"} if loopback_binds else env
