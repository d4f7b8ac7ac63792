"""The launch's pieces that need no running server: command lines as exact lists (NVIDIA's
launch_triton_server.py scheme, shared/reference/trtllm.md §4, plus the CPU flags of
triton-on-cpu.md), finding tritonserver and preparing the python backend folder, the world-size
check against an engine folder, and the port checks."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from conftest import free_ports
from trtglm.errors import DependencyError, ModelFileError, UsageError
from trtglm.model_repository import engine_world_size, profile_ports
from trtglm.serve import checks, tritonserver
from trtglm.serve.checks import check_ports, resolve_world_size
from trtglm.serve.command import Endpoints, launch_args, mpi_major, restricted_args, server_args
from trtglm.serve.tritonserver import find_tritonserver, prepare_python_backend

TS = "/opt/tritonserver/bin/tritonserver"
REPO = "/models/repo"
LOOPBACK = Endpoints("127.0.0.1", 8000, 8001, 8002)

RANK0 = [TS, "--model-repository=/models/repo", "--disable-auto-complete-config",
         "--backend-config=python,shm-region-prefix-name=prefix0_", "--backend-directory=/b/backends",
         "--http-address=127.0.0.1", "--http-port=8000", "--grpc-address=127.0.0.1", "--grpc-port=8001",
         "--metrics-address=127.0.0.1", "--metrics-port=8002", "--allow-cpu-metrics=true", "--allow-gpu-metrics=false",
         "--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=5"]


def other_rank(rank: int) -> list[str]:
    return [TS, "--model-repository=/models/repo", "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name=prefix{rank}_", "--backend-directory=/b/backends",
            "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
            "--model-control-mode=explicit", "--load-model=tensorrt_llm", "--exit-timeout-secs=5"]


MPIRUN = ["/usr/bin/mpirun", "--allow-run-as-root", "--noprefix", "--bind-to", "none",
          "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]
EXPORTS = ["-x", "PATH", "-x", "LD_LIBRARY_PATH", "-x", "PYTHONPATH"]


def build(world_size: int, endpoints: Endpoints = LOOPBACK, cpu_count: int = 16, **kw) -> list[str]:
    return launch_args(TS, REPO, world_size, endpoints, mpirun="/usr/bin/mpirun", backend_dir="/b/backends",
                       export_vars=["PATH", "LD_LIBRARY_PATH", "PYTHONPATH"], cpu_count=cpu_count, **kw)


# --- command lines ---------------------------------------------------------------------------------


def test_rank0_serves_clients_on_its_ports():
    assert server_args(TS, REPO, 0, LOOPBACK, backend_dir="/b/backends") == RANK0


def test_other_ranks_open_no_endpoints_and_load_only_tensorrt_llm():
    assert server_args(TS, REPO, 3, LOOPBACK, backend_dir="/b/backends") == other_rank(3)


def test_world_size_1_is_tritonserver_without_mpirun():
    assert build(1) == RANK0


def test_world_size_2_is_one_mpirun_with_a_section_per_rank():
    assert build(2, output_dir="/logs/ranks") == [
        *MPIRUN, "--output-filename", "/logs/ranks:nocopy", *EXPORTS,
        "-n", "1", *RANK0, ":", "-n", "1", *other_rank(1)]


def test_open_mpi_5_gets_its_own_loopback_and_log_flags():
    mpirun5 = ["/usr/bin/mpirun", "--allow-run-as-root", "--noprefix", "--bind-to", "none",
               "--mca", "btl_tcp_if_include", "lo"]  # PRRTE refuses loopback as its bootstrap network
    assert build(2, output_dir="/logs/ranks", mpi_version=5) == [
        *mpirun5, "--output", "dir=/logs/ranks", *EXPORTS, "-n", "1", *RANK0, ":", "-n", "1", *other_rank(1)]


@pytest.mark.parametrize("text, major", [("mpirun (Open MPI) 4.1.4\n\nReport bugs to …", 4),
                                         ("mpirun (Open MPI) 5.0.11\n", 5)])
def test_the_open_mpi_major_version_comes_from_mpirun_version(text, major):
    assert mpi_major(text) == major


@pytest.mark.parametrize("text, error", [("HYDRA build details:\n    Version: 4.1.2", "not Open MPI"),
                                          ("mpirun (Open MPI) 3.1.6", "Open MPI 3 is not supported")])
def test_another_mpi_or_an_unknown_open_mpi_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        mpi_major(text)


def test_world_size_4_on_two_cores_oversubscribes():
    assert build(4, cpu_count=2) == [*MPIRUN, "--oversubscribe", *EXPORTS,
                                     "-n", "1", *RANK0, ":", "-n", "1", *other_rank(1),
                                     ":", "-n", "1", *other_rank(2), ":", "-n", "1", *other_rank(3)]


def test_ports_host_and_shm_base_reach_rank0():
    args = server_args(TS, REPO, 0, Endpoints("0.0.0.0", 9000, 9100, 9200), shm_base="run7_rank", exit_timeout_s=2)
    assert args == [TS, "--model-repository=/models/repo", "--disable-auto-complete-config",
                    "--backend-config=python,shm-region-prefix-name=run7_rank0_",
                    "--http-address=0.0.0.0", "--http-port=9000", "--grpc-address=0.0.0.0", "--grpc-port=9100",
                    "--metrics-address=0.0.0.0", "--metrics-port=9200", "--allow-cpu-metrics=true",
                    "--allow-gpu-metrics=false", "--model-control-mode=explicit", "--load-model=*",
                    "--exit-timeout-secs=2"]


def test_client_urls_reach_a_wildcard_bind_through_loopback():
    assert Endpoints("0.0.0.0", 1, 2, 3).urls() == {"http": "http://127.0.0.1:1", "grpc": "127.0.0.1:2",
                                                     "metrics": "http://127.0.0.1:3/metrics"}
    assert Endpoints("::", 1, 2, 3).urls()["http"] == "http://[::1]:1"
    assert Endpoints("10.1.2.3", 1, 2, 3).urls()["grpc"] == "10.1.2.3:2"


# --- finding tritonserver ------------------------------------------------------------------------


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_default_binaries(monkeypatch, tmp_path):
    monkeypatch.setattr(tritonserver, "CONTAINER_BINARY", tmp_path / "absent" / "tritonserver")
    monkeypatch.setattr(tritonserver, "_wheel_binary", lambda: None)


def test_find_order_flag_then_env_then_path(tmp_path, no_default_binaries):
    flag, env, on_path = (executable(tmp_path / d / "tritonserver") for d in ("flag", "env", "path"))
    environ = {"TRITONSERVER": str(env), "PATH": str(on_path.parent)}
    assert find_tritonserver(str(flag), environ) == flag
    assert find_tritonserver(None, environ) == env
    assert find_tritonserver(None, {"PATH": str(on_path.parent)}) == on_path


def test_find_falls_back_to_the_wheel(tmp_path, monkeypatch):
    wheel = executable(tmp_path / "pytriton" / "tritonserver" / "bin" / "tritonserver")
    monkeypatch.setattr(tritonserver, "CONTAINER_BINARY", tmp_path / "absent")
    monkeypatch.setattr(tritonserver, "_wheel_binary", lambda: wheel)
    assert find_tritonserver(None, {"PATH": ""}) == wheel


def test_missing_tritonserver_is_one_line(tmp_path, no_default_binaries):
    with pytest.raises(DependencyError, match="tritonserver not found"):
        find_tritonserver(None, {"PATH": str(tmp_path)})
    with pytest.raises(DependencyError, match="--tritonserver .*not an executable"):
        find_tritonserver(str(tmp_path / "nope"), {})


def test_real_wheel_binary_is_found_and_its_python_backend_prepared(tmp_path):
    pytest.importorskip("pytriton")
    binary = find_tritonserver(None, {"PATH": ""})
    backends = tritonserver.backend_directory(binary, cache_dir=tmp_path)
    python = backends / "python"
    root = binary.parent.parent
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert sorted(os.listdir(python)) == ["libtriton_python.so", "triton_python_backend_stub",
                                          "triton_python_backend_utils.py"]
    assert (python / "triton_python_backend_stub").resolve() == \
        (root / "python_backend_stubs" / minor / "triton_python_backend_stub").resolve()
    library = root / "backends" / "python" / "libtriton_python.so"
    assert (python / "libtriton_python.so").resolve() == library.resolve()


def fake_wheel(root: Path, minors: tuple[str, ...]) -> Path:
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        executable(root / "backends" / "python" / name)
    for minor in minors:
        executable(root / "python_backend_stubs" / minor / "triton_python_backend_stub")
    return root


def test_backend_folder_links_the_stub_of_the_requested_python(tmp_path):
    root = fake_wheel(tmp_path / "wheel", ("3.10", "3.11"))
    backends = prepare_python_backend(root, tmp_path / "cache", python=(3, 10))
    stub = backends / "python" / "triton_python_backend_stub"
    assert stub.is_symlink() and stub.resolve() == root / "python_backend_stubs" / "3.10" / "triton_python_backend_stub"
    assert prepare_python_backend(root, tmp_path / "cache", python=(3, 10)) == backends  # reused
    other = prepare_python_backend(root, tmp_path / "cache", python=(3, 11))
    assert other != backends
    with pytest.raises(DependencyError, match=r"Python 3\.12"):
        prepare_python_backend(root, tmp_path / "cache", python=(3, 12))


# --- world size ---------------------------------------------------------------------------------


def repo_with_engine(tmp_path: Path, engine_file: str | None, content: str, parameter: str | None = None) -> Path:
    engine = tmp_path / "engine"
    engine.mkdir(parents=True)
    if engine_file:
        (engine / engine_file).write_text(content)
    model = tmp_path / "repo" / "tensorrt_llm"
    model.mkdir(parents=True)
    value = str(engine) if parameter is None else parameter
    (model / "config.pbtxt").write_text(
        'name: "tensorrt_llm"\nbackend: "python"\n'
        f'parameters {{ key: "gpt_model_path", value {{ string_value: "{value}" }} }}\n')
    return model.parent


def test_world_size_from_trtglm_manifest(tmp_path):
    repo = repo_with_engine(tmp_path, "trtglm.json", '{"mapping": {"world_size": 4, "tp_size": 2, "pp_size": 2}}')
    assert engine_world_size(repo) == 4
    assert resolve_world_size(repo, None) == 4
    assert resolve_world_size(repo, 4) == 4
    with pytest.raises(UsageError, match=r"--world-size 2 does not match the engine's tp × pp = 4"):
        resolve_world_size(repo, 2)


def test_world_size_from_a_tensorrt_llm_engine_config(tmp_path):
    repo = repo_with_engine(tmp_path, "config.json",
                            '{"pretrained_config": {"mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}}}')
    assert engine_world_size(repo) == 2


def test_repository_without_tensorrt_llm_has_no_engine_to_match(tmp_path):
    (tmp_path / "echo").mkdir()
    assert engine_world_size(tmp_path) is None
    assert resolve_world_size(tmp_path, None) == 1
    assert resolve_world_size(tmp_path, 3) == 3


def test_the_ports_the_engines_profile_names(tmp_path):
    manifest = '{"mapping": {"world_size": 1}, "profile": {"serve": {"http_port": 9100, "grpc_port": 9101, ' \
               '"metrics_port": 9102, "world_size": 1}}}'
    assert profile_ports(repo_with_engine(tmp_path / "a", "trtglm.json", manifest)) == {
        "http": 9100, "grpc": 9101, "metrics": 9102}
    built_elsewhere = '{"pretrained_config": {"mapping": {"world_size": 1}}}'
    assert profile_ports(repo_with_engine(tmp_path / "b", "config.json", built_elsewhere)) == {}
    (tmp_path / "c" / "echo").mkdir(parents=True)
    assert profile_ports(tmp_path / "c") == {}


def test_unrendered_or_missing_engine_folder_is_refused(tmp_path):
    with pytest.raises(ModelFileError, match="gpt_model_path .* is not set"):
        engine_world_size(repo_with_engine(tmp_path / "a", None, "", parameter="${engine_dir}"))
    with pytest.raises(ModelFileError, match="does not exist"):
        engine_world_size(repo_with_engine(tmp_path / "b", None, "", parameter="/no/such/engine"))
    with pytest.raises(ModelFileError, match="neither trtglm.json nor config.json"):
        engine_world_size(repo_with_engine(tmp_path / "c", None, ""))


@pytest.mark.parametrize("value", [0, -2, 1.5, "two", True])
def test_world_size_must_be_a_positive_whole_number(tmp_path, value):
    with pytest.raises(UsageError, match="--world-size"):
        resolve_world_size(tmp_path, value)


def test_missing_repository(tmp_path):
    with pytest.raises(ModelFileError, match="not a folder"):
        checks.repo_folder(tmp_path / "nope")


# --- ports --------------------------------------------------------------------------------------


def test_busy_port_is_refused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        http, metrics = free_ports(2)
        with pytest.raises(UsageError, match=f"--grpc-port {port} on 127.0.0.1 is in use"):
            check_ports(Endpoints("127.0.0.1", http, port, metrics))


def test_free_ports_pass_and_bad_ones_are_refused():
    check_ports(Endpoints("127.0.0.1", *free_ports(3)))
    with pytest.raises(UsageError, match="must differ"):
        check_ports(Endpoints("127.0.0.1", 9000, 9000, 9002))
    with pytest.raises(UsageError, match="--metrics-port must be a port number"):
        check_ports(Endpoints("127.0.0.1", 9000, 9001, 70000))
    with pytest.raises(UsageError, match="--host 192.0.2.1: not an address of this machine"):
        check_ports(Endpoints("192.0.2.1", 9000, 9001, 9002))



def test_rank0_restricts_the_repository_shared_memory_trace_and_logging_apis_to_the_launch_key():
    restricted = "model-repository,shared-memory,trace,logging:trtglm-api-key=s3cret"
    assert restricted_args("s3cret") == [f"--http-restricted-api={restricted}",
                                         f"--grpc-restricted-protocol={restricted}"]
    # the key never reaches a command line: every rank's is the same without and with one
    assert all("s3cret" not in arg for arg in build(2, output_dir="/logs/ranks"))
