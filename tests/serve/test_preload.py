"""The library preloaded into a launch's server processes (serve/preload.py), built with the machine's C
compiler and loaded into real programs: a program named tritonserver gets the hidden flags without them on
its command line, shared memory stays private, and wildcard binds land on loopback where asked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trtglm.serve.preload import ARGS_VAR, LOOPBACK_VAR, preload_env, preload_library


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    return preload_library(tmp_path_factory.mktemp("preload"))


def test_the_environment_preloads_the_library_first_with_the_hidden_flags():
    env = preload_env(Path("/c/lib.so"), ["--a=1", "--b=2"], False, "/other.so")
    assert env == {"LD_PRELOAD": "/c/lib.so:/other.so", ARGS_VAR: "--a=1\n--b=2"}
    assert preload_env(Path("/c/lib.so"), [], True)[LOOPBACK_VAR] == "1"
    with pytest.raises(ValueError, match="line break"):
        preload_env(Path("/c/lib.so"), ["--a=1\n--b"], False)


def test_a_second_build_reuses_the_library(library):
    stamp = library.stat().st_mtime_ns
    assert preload_library(library.parent.parent) == library and library.stat().st_mtime_ns == stamp


def run_as(program: str, tmp_path: Path, library: Path, *args: str, **env: str) -> str:
    """`/bin/cat ARGS` under the name `program` with the library preloaded; its output."""
    named = tmp_path / program
    named.symlink_to("/bin/cat")
    done = subprocess.run([str(named), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "LD_PRELOAD": str(library), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tritonserver_gets_the_hidden_arguments_but_its_command_line_does_not_show_them(library, tmp_path):
    secret = tmp_path / "secret-file"
    secret.write_text("[read through a hidden argument]")
    out = run_as("tritonserver", tmp_path, library, "/proc/self/cmdline", **{ARGS_VAR: str(secret)})
    command_line, hidden = out.split("\0")[:-1], out.split("\0")[-1]
    assert command_line == [str(tmp_path / "tritonserver"), "/proc/self/cmdline"]
    assert hidden == "[read through a hidden argument]"


def test_other_programs_get_no_hidden_arguments(library, tmp_path):
    secret = tmp_path / "secret-file"
    secret.write_text("never read")
    out = run_as("mpirun", tmp_path, library, "/proc/self/cmdline", **{ARGS_VAR: str(secret)})
    assert "never read" not in out


PYTHON_SHM = """
import os, sys
name = f"trtglm-preload-test-{os.getpid()}"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.fchmod(fd, 0o644)  # as Boost.Interprocess does after creating a segment
plain = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.fchmod(plain, 0o644)
print(oct(os.stat(f"/dev/shm/{name}").st_mode & 0o777), oct(os.stat(sys.argv[1]).st_mode & 0o777))
os.unlink(f"/dev/shm/{name}")
"""


def test_shared_memory_stays_private_and_other_files_are_left_alone(library, tmp_path):
    done = subprocess.run([sys.executable, "-c", PYTHON_SHM, str(tmp_path / "plain")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "LD_PRELOAD": str(library)})
    assert done.stdout.split() == ["0o600", "0o644"], done.stderr


PYTHON_BIND = """
import socket
for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    with socket.socket(family) as s:
        s.bind((wildcard, 0))
        print(s.getsockname()[0])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[0])
"""


@pytest.mark.parametrize("loopback, expected", [(True, ["127.0.0.1", "::1", "127.0.0.1"]),
                                                (False, ["0.0.0.0", "::", "127.0.0.1"])])
def test_wildcard_binds_land_on_loopback_only_where_asked(library, loopback, expected):
    env = {**os.environ, "LD_PRELOAD": str(library)}
    env.pop(LOOPBACK_VAR, None)
    done = subprocess.run([sys.executable, "-c", PYTHON_BIND], capture_output=True, text=True, timeout=60,
                          env={**env, **({LOOPBACK_VAR: "1"} if loopback else {})})
    assert done.stdout.split() == expected, done.stderr
