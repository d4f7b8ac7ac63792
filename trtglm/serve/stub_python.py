"""The Python environment that the python backend's stubs run in, for nvidia-pytriton's server.

A python-backend stub embeds libpython and takes its packages from the environment of the
first `python3` on PATH; it does not read PYTHONPATH. And the stubs that nvidia-pytriton 0.7.0
ships (Triton 2.51) are built against numpy 1's C structures: under numpy ≥ 2 a stub reads a
dtype's item size from the field that numpy 2 moved, copies every BYTES input as its first
byte repeated (the length 27 arrives as 0x1B1B1B1B), and dies in `deserialize_bytes_tensor`,
so no string ever reaches a model (docs/troubleshooting.md has the evidence).

So `launch` gives the stubs an environment of its own, a venv of the running interpreter in
the cache (`$XDG_CACHE_HOME/trtglm/stub-python/…`) whose path is launch's own `sys.path`
(PYTHONPATH entries and the running venv included, and their `.pth` hooks run): the stubs
import exactly what `trtglm launch` imports. When that means numpy ≥ 2, a numpy < 2 installed
once per Python version by pip (from its index or its configured `--find-links`) goes first.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import shutil
import site
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from trtglm.errors import DependencyError

log = logging.getLogger(__name__)

NUMPY_FOR_STUBS = "numpy<2"
COMPLETE = ".trtglm-complete"  # written last: a folder without it is an interrupted build


def stub_python_bin(cache_dir: Path, project_root: Path) -> Path:
    """The `bin/` folder to put first on the servers' PATH (created on first use, then reused)."""
    numpy_dir = numpy1_dir(cache_dir) if numpy_major() >= 2 else None
    paths = [str(p) for p in (numpy_dir, project_root) if p] + launch_paths()
    key = hashlib.sha256("\n".join([sys.version, _base_executable(), *paths]).encode()).hexdigest()[:16]
    env_dir = cache_dir / "stub-python" / key
    if not (env_dir / COMPLETE).is_file():
        _build_atomically(env_dir, lambda tmp: _make_venv(tmp, paths))
    return env_dir / "bin"


def numpy_major() -> int:
    """The major version of the numpy that this process (and so the stubs' path) finds first."""
    try:
        return int(importlib.metadata.version("numpy").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def numpy1_dir(cache_dir: Path) -> Path:
    """A folder holding numpy < 2 for this Python version, installed by pip on first use."""
    target = cache_dir / f"numpy1-py{sys.version_info.major}.{sys.version_info.minor}"
    if not (target / COMPLETE).is_file():
        print(f"python stubs: numpy {importlib.metadata.version('numpy')} breaks nvidia-pytriton's python "
              f"backend stub (built for numpy 1); installing {NUMPY_FOR_STUBS} for the stubs in {target}", flush=True)
        _build_atomically(target, _pip_install_numpy1)
    log.info("python stubs: numpy < 2 from %s", target)
    return target


def launch_paths() -> list[str]:
    """This process's import path as folders (the current folder and missing entries left out)."""
    return list(dict.fromkeys(p for p in sys.path if p and Path(p).is_dir()))


def _pip_install_numpy1(target: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--target", str(target), NUMPY_FOR_STUBS]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DependencyError(f"the python stubs need {NUMPY_FOR_STUBS} (nvidia-pytriton's stub cannot read numpy "
                              f"{importlib.metadata.version('numpy')}'s arrays) and pip could not install it ({last}); "
                              "make a numpy 1.26 wheel reachable to pip (--find-links / PIP_FIND_LINKS) or put one "
                              "first on PYTHONPATH")


def _make_venv(env_dir: Path, paths: list[str]) -> None:
    """A venv without packages whose site folder lists `paths` and runs the `.pth` hooks of launch's site folders."""
    venv.EnvBuilder(symlinks=True, with_pip=False).create(env_dir)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_dir = env_dir / "lib" / version / "site-packages"
    hooks = [d for d in _site_dirs() if d in paths]
    # No comprehension: site.py runs the line with exec(), whose names a nested scope cannot see.
    lines = [*paths, f"import site; any(map(site.addsitedir, {hooks!r}))"]
    (site_dir / "trtglm-launch-path.pth").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _site_dirs() -> list[str]:
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return [str(Path(d)) for d in (*site.getsitepackages(), *user)]


def _base_executable() -> str:
    return str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())


def _build_atomically(target: Path, build) -> None:
    """Run `build(tmp)` in a sibling temporary folder, mark it complete and rename it to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        (tmp / COMPLETE).touch()
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except OSError:
        if not (target / COMPLETE).is_file():  # not a parallel launch that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
