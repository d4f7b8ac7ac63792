"""`launch --replicas N` without running it: where each replica goes (GPUs, ports, CPUs), the front's Envoy
configuration (checked by Envoy's own validator) and its endpoint files, and every replica's command line and
environment for an engine of either backend (NVIDIA's tensorrtllm included, which cannot run here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import free_ports
from support.cli_calls import patch_repo
from support.repos import make_engine, upstream_copy
from support.topology import hyperthreaded
from trtglm.errors import UsageError
from trtglm.serve import replicas as placing
from trtglm.serve.command import Endpoints
from trtglm.serve.fleet import FleetSpec, plan_fleet, wants_front
from trtglm.serve.front import ROUTES, endpoint_files, find_envoy, front_config
from trtglm.serve.launch_spec import LaunchSpec
from trtglm.serve.replicas import ReplicaPlace, cpu_shares, gpu_groups, replica_endpoints, visible_gpus
from trtglm.serve.state import LaunchDir

FRONT = Endpoints("0.0.0.0", 8000, 8001, 8002, 8003)


# --- where replicas go -------------------------------------------------------------------------------


def test_replica_i_gets_the_ith_group_of_visible_gpus():
    assert gpu_groups(2, 1, ["0", "1", "2"], None) == [("0",), ("1",)]
    assert gpu_groups(2, 2, ["4", "5", "6", "7"], None) == [("4", "5"), ("6", "7")]
    assert gpu_groups(2, 2, None, None) == [None, None]  # no driver: nothing to assign
    assert gpu_groups(2, 1, ["0", "1", "2", "3"], ["3", "1"]) == [("3",), ("1",)]


@pytest.mark.parametrize("visible, chosen, words", [
    (["0"], None, "2 replica(s) × world size 1 need 2 GPUs, but 1 are visible (0)"),
    ([], None, "need 2 GPUs, but 0 are visible (none)"),
    (["0", "1"], ["0"], "--gpus must name 2 different GPUs"),
    (["0", "1"], ["0", "0"], "--gpus must name 2 different GPUs"),
    (["0", "1"], ["0", "5"], "--gpus 5: not among the visible GPUs (0,1)"),
])
def test_too_few_or_wrong_gpus_are_one_line(visible, chosen, words):
    with pytest.raises(UsageError, match=".*") as error:
        gpu_groups(2, 1, visible, chosen)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_visible_gpus_are_cuda_visible_devices_or_the_drivers_list(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"PATH": str(tmp_path)}) is None  # no nvidia-smi: a CPU machine
    smi = tmp_path / "nvidia-smi"  # a stand-in for the driver's tool, which a CPU machine lacks
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-x)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-y)'\n")
    smi.chmod(0o755)
    assert visible_gpus({"PATH": str(tmp_path)}) == ["0", "1"]


def test_each_replica_has_its_own_port_block_on_loopback_but_metrics():
    assert replica_endpoints(0, 8100, FRONT) == Endpoints("127.0.0.1", 8100, 8101, 8102, 8103, metrics_host="0.0.0.0")
    second = replica_endpoints(1, 8100, FRONT)
    assert second.ports() == {"http": 8104, "grpc": 8105, "metrics": 8106, "openai": 8107}
    assert second.urls()["metrics"] == "http://127.0.0.1:8106/metrics"
    assert "openai" not in replica_endpoints(0, 8100, Endpoints("127.0.0.1", 1, 2, 3)).ports()
    with pytest.raises(UsageError, match="would pass 65535"):
        replica_endpoints(3, 65530, FRONT)


def test_cpu_shares_are_whole_cores_apart(tmp_path):
    sysfs = hyperthreaded(tmp_path, 8)  # 16 CPUs: cpu N and N + 8 share a core
    shares = cpu_shares(2, set(range(16)), sysfs)
    assert shares == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert cpu_shares(3, set(range(16)), sysfs)[2] == (6, 7, 14, 15)  # 3 + 3 + 2 cores
    assert cpu_shares(1, set(range(16)), sysfs) == [None]
    assert cpu_shares(20, set(range(16)), sysfs) == [None] * 20  # fewer cores than replicas: share them all


def test_replicas_need_the_front_and_at_least_one_replica():
    assert wants_front(1, None, "127.0.0.1") is False and wants_front(1, True, "127.0.0.1") is True
    assert wants_front(2, None, "127.0.0.1") is True
    for exposed in ("0.0.0.0", "::", "10.1.2.3", "myhost"):  # reachable from elsewhere: guarded by the front
        assert wants_front(1, None, exposed) is True and wants_front(1, False, exposed) is False
    assert wants_front(1, None, "::1") is False and wants_front(1, None, "localhost") is False
    with pytest.raises(UsageError, match="leave out --no-front"):
        wants_front(2, False, "127.0.0.1")
    with pytest.raises(UsageError, match="--replicas must be a whole number ≥ 1, not 0"):
        placing.place_replicas(0, 1, FRONT, None, None, {})


# --- the front's configuration ----------------------------------------------------------------------


def replica_ports(count: int) -> list[Endpoints]:
    return [replica_endpoints(i, 9000, FRONT) for i in range(count)]


def test_envoy_accepts_the_rendered_configuration(tmp_path):
    """Envoy's own validator (`--mode validate`) reads the whole bootstrap, its routes, clusters and filters."""
    envoy = find_envoy()
    config = front_config(FRONT, 2, tmp_path / "eds", tmp_path / "admin.sock")
    for name, body in endpoint_files(FRONT, replica_ports(2), [True, False]).items():
        (tmp_path / "eds").mkdir(exist_ok=True)
        (tmp_path / "eds" / f"{name}.json").write_text(json.dumps(body))
    (tmp_path / "envoy.json").write_text(json.dumps(config))
    checked = subprocess.run([str(envoy), "--mode", "validate", "-c", str(tmp_path / "envoy.json"),
                              "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_front_balances_least_request_retries_elsewhere_and_never_cuts_a_stream(tmp_path):
    config = front_config(FRONT, 3, tmp_path, tmp_path / "admin.sock")
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    assert {name: listener["address"]["socket_address"]["port_value"] for name, listener in listeners.items()} == \
        {"http": 8000, "grpc": 8001, "openai": 8003, "metrics": 8002}
    for route in ROUTES:
        manager = listeners[route.cluster]["filter_chains"][0]["filters"][0]["typed_config"]
        assert manager["stream_idle_timeout"] == "0s"
        forward = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        assert forward["timeout"] == "0s" and forward["cluster"] == route.cluster
        retry = forward["retry_policy"]
        assert retry["num_retries"] == 2 and "connect-failure" in retry["retry_on"] and "reset" in retry["retry_on"]
        assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    for route in ROUTES:
        cluster = clusters[route.cluster]
        assert cluster["lb_policy"] == "LEAST_REQUEST"
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0  # none ready: 503, not a guess
    assert "http2_protocol_options" in json.dumps(clusters["grpc"]) and "http2" not in json.dumps(clusters["http"])
    assert config["admin"]["address"]["pipe"]["mode"] == 0o600  # no admin port
    one = front_config(FRONT, 1, tmp_path, tmp_path / "admin.sock")
    assert "retry_policy" not in json.dumps(one)  # nowhere else to go


def test_endpoint_files_mark_each_replica_as_the_supervisor_sees_it():
    files = endpoint_files(FRONT, replica_ports(2), [True, False])
    members = files["grpc"]["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [m["health_status"] for m in members] == ["HEALTHY", "UNHEALTHY"]
    assert [m["endpoint"]["address"]["socket_address"]["port_value"] for m in members] == [9001, 9005]
    assert [m["endpoint"]["health_check_config"]["port_value"] for m in members] == [9000, 9004]  # asked over HTTP
    assert "health_check_config" not in json.dumps(files["http"])


# --- every replica's command line and environment ----------------------------------------------------


@pytest.fixture
def nvidia_repo(tmp_path, fixture_dir) -> Path:
    """NVIDIA's layout patched for a TensorRT engine of tp 2 (served by NVIDIA's C++ backend)."""
    engine = make_engine(tmp_path, "tensorrt", fixture_dir, mapping={"world_size": 2, "tp_size": 2},
                         serve={"world_size": 2})
    return patch_repo(engine, None, tmp_path / "repo", template=upstream_copy(tmp_path, "v0.19.0"))


def server_fields(repo: Path, world_size: int) -> dict:
    return {"repo": str(repo), "world_size": world_size, "tritonserver": "/opt/tritonserver/bin/tritonserver",
            "backend_dir": None, "mpirun": "/usr/bin/mpirun", "mpi_version": 4, "preload": None, "python_bin": None,
            "timeout_s": 60.0, "server_flags": ()}


def test_each_replica_of_a_tensorrt_engine_runs_mpirun_on_its_own_gpus_and_ports(nvidia_repo, tmp_path):
    front = Endpoints("127.0.0.1", *free_ports(4))
    base = free_ports(1)[0] - 8
    places = placing.place_replicas(2, 2, front, base, None, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    fleet = plan_fleet(server_fields(nvidia_repo, 2), places, front, Path("/bin/envoy"),
                       LaunchDir(tmp_path / "state"), tmp_path / "logs", detached=True)
    assert fleet.gpus == [["0", "1"], ["2", "3"]]
    for index, replica in enumerate(fleet.replicas):
        env = {"PATH": "/usr/bin", **replica.environment}
        argv = replica.command(env)
        assert replica.environment == {"CUDA_VISIBLE_DEVICES": ",".join(fleet.gpus[index])}
        assert argv[0] == "/usr/bin/mpirun"
        assert any(argv[i:i + 2] == ["-x", "CUDA_VISIBLE_DEVICES"] for i in range(len(argv)))  # to every rank
        http = base + 4 * index
        assert f"--http-port={http}" in argv and f"--grpc-port={http + 1}" in argv
        assert f"--metrics-port={http + 2}" in argv and "--http-address=127.0.0.1" in argv
        assert f"--model-repository={nvidia_repo}" in argv
        assert sum(arg.startswith("--model-repository") for arg in argv) == 2  # two ranks
        assert f"shm-region-prefix-name={replica.shm_base}0_" in " ".join(argv)
        assert replica.launch_dir == str(tmp_path / "state" / f"replica-{index}")
    assert fleet.replicas[0].shm_base != fleet.replicas[1].shm_base
    assert fleet.replicas[0].api_key != fleet.replicas[1].api_key
    again = FleetSpec.load(_saved(fleet, tmp_path / "fleet.json"))  # what a detached fleet reads
    assert again == fleet


def _saved(fleet: FleetSpec, path: Path) -> Path:
    fleet.save(path)
    assert os.stat(path).st_mode & 0o077 == 0  # it holds the replicas' secrets
    return path


def test_replica_ports_that_clash_are_refused_in_one_line(tmp_path):
    front = Endpoints("127.0.0.1", *free_ports(4))
    places = placing.place_replicas(2, 1, front, front.http_port - 4, None, {})  # replica 1 lands on the front
    with pytest.raises(UsageError, match="replica 1's ports \\(--replica-ports\\) overlap the front's"):
        plan_fleet(server_fields(tmp_path, 1), places, front, Path("/bin/envoy"), LaunchDir(tmp_path), tmp_path, True)
    base = free_ports(1)[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 5))
        busy.listen()
        places = placing.place_replicas(2, 1, front, base, None, {})
        with pytest.raises(UsageError, match=f"replica 1's grpc port \\(--replica-ports\\) {base + 5} on 127.0.0.1 "
                                             "is in use"):
            plan_fleet(server_fields(tmp_path, 1), places, front, Path("/bin/envoy"), LaunchDir(tmp_path),
                       tmp_path, True)


def test_a_launch_spec_round_trips_with_its_environment_and_cpus(tmp_path):
    place = ReplicaPlace(0, ("3",), replica_endpoints(0, 9000, FRONT), (4, 5))
    spec = LaunchSpec(**server_fields(tmp_path, 1), endpoints=place.endpoints, launch_dir=str(tmp_path),
                      log_dir=str(tmp_path), launch_id="0123abcd", environment=place.environment(), cpus=place.cpus)
    spec.save(tmp_path / "spec.json")
    assert LaunchSpec.load(tmp_path / "spec.json") == spec
