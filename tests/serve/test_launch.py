"""`trtglm launch`, `stop` and `models` against real tritonserver processes (nvidia-pytriton's
binary, CPU, python backend) and a real Open MPI `mpirun`, on free loopback ports.

The repositories are the tests' own: `tensorrt_llm` answers with the OMPI_COMM_WORLD_RANK it
sees and fails its initialisation on the rank named by $TEST_FAIL_RANK; `echo` returns its
input. Both drop a marker file `rank{R}-{model}` when loaded, which shows which rank loaded
what. Leftovers are looked for the way a user would: processes whose command line names the
test's repository, and /dev/shm regions with the launch's prefix.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import free_ports, kill_repo_processes, repo_processes
from tqdm import tqdm

from trtglm.files import PHASE_FILE, read_phase, report_phase
from trtglm.processes import alive
from trtglm.serve.rank_logs import FatalSignals
from trtglm.serve.stubs import is_stub, stub_model
from trtglm.serve.supervise import show_phase

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLI = ["-m", "trtglm"]
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

RANK_MODEL = '''
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def rank():
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))


class TritonPythonModel:
    def initialize(self, args):
        if os.environ.get("TEST_FAIL_RANK") == str(rank()):
            raise RuntimeError(f"deliberate failure on rank {rank()}")
        Path(os.environ["TEST_MARKERS"], f"rank{rank()}-{args['model_name']}").touch()

    def execute(self, requests):
        out = np.array([rank()], np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("RANK", out)]) for _ in requests]
'''

ECHO_MODEL = '''
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(float(os.environ.get("TEST_SLOW_ECHO", "0")))
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "-1")
        Path(os.environ["TEST_MARKERS"], f"rank{rank}-{args['model_name']}").touch()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
'''


def config(name: str, output: str, extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]\n'
            f'output [ {{ name: "{output}", data_type: TYPE_INT32, dims: [ 1 ] }} ]\n'
            'instance_group [ { count: 1, kind: KIND_CPU } ]\n' + extra)


def make_repo(root: Path, tp_size: int) -> Path:
    """A repository whose tensorrt_llm names a (fake) engine folder of tp_size ranks."""
    engine = root / "engine"
    engine.mkdir(parents=True)
    (engine / "trtglm.json").write_text(json.dumps({"mapping": {"world_size": tp_size, "tp_size": tp_size,
                                                                "pp_size": 1}}))
    repo = root / "repo"
    engine_parameter = f'parameters {{ key: "gpt_model_path", value {{ string_value: "{engine}" }} }}\n'
    for name, output, code, extra in (("tensorrt_llm", "RANK", RANK_MODEL, engine_parameter),
                                      ("echo", "OUT", ECHO_MODEL, "")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config(name, output, extra))
        (repo / name / "1" / "model.py").write_text(code)
    return repo




def shm_regions(base: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{base}*"))


def infer(port: int, model: str, value: int = 7) -> dict:
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [value]}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    with NO_PROXY.open(request, timeout=10) as reply:
        return {o["name"]: o["data"] for o in json.loads(reply.read())["outputs"]}


def http_status(url: str) -> int:
    try:
        with NO_PROXY.open(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Env:
    """One test's world: a repository, ports, its own state folder, and cleanup of whatever is left."""

    def __init__(self, tmp_path: Path, tp_size: int):
        self.repo = make_repo(tmp_path, tp_size)
        self.markers = tmp_path / "markers"
        self.markers.mkdir()
        self.state_dir = tmp_path / "state"
        self.http, self.grpc, self.metrics = free_ports()
        self.env = {**os.environ, "TRTGLM_STATE_DIR": str(self.state_dir), "TEST_MARKERS": str(self.markers),
                    "PYTHONUNBUFFERED": "1"}
        self.popens: list[subprocess.Popen] = []

    def ports(self) -> list[str]:
        return ["--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics)]

    def run(self, *args: str, timeout: float = 90, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *CLI, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env={**self.env, **env})

    def start(self, *args: str, **env) -> subprocess.Popen:
        """A foreground `launch`, left running."""
        proc = subprocess.Popen([sys.executable, *CLI, "launch", "--repo", str(self.repo), *self.ports(),
                                 "--timeout", "60", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env={**self.env, **env})
        self.popens.append(proc)
        return proc

    def wait_ready(self, proc: subprocess.Popen, limit_s: float = 60) -> str:
        """What a foreground `launch` printed up to its endpoints (it prints them once ready)."""
        deadline, out = time.monotonic() + limit_s, ""
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while "  logs " not in out and time.monotonic() < deadline:
                if selector.select(timeout=0.5):
                    chunk = os.read(proc.stdout.fileno(), 65536)  # unbuffered: select sees what is left
                    if not chunk:
                        _, err = proc.communicate()
                        pytest.fail(f"launch exited {proc.returncode} before ready:\n{out}\n{err}")
                    out += chunk.decode()
        if "  logs " not in out:
            pytest.fail(f"launch did not report ready in time:\n{out}")
        assert http_status(f"http://127.0.0.1:{self.http}/v2/health/ready") == 200
        return out

    def state(self) -> dict:
        files = list(self.state_dir.glob("*/state.json"))
        assert len(files) == 1, files
        return json.loads(files[0].read_text())

    def markers_seen(self) -> set[str]:
        return {p.name for p in self.markers.iterdir()}

    def assert_clean(self, shm_base: str) -> None:
        left = [(p.pid, p.name()) for p in repo_processes(self.repo) if alive(p)]
        assert left == [], f"processes left running: {left}"
        assert shm_regions(shm_base) == []

    def cleanup(self) -> None:
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        kill_repo_processes(self.repo)
        for state in self.state_dir.glob("*/state.json"):
            for region in shm_regions(json.loads(state.read_text()).get("shm_base", "?")):
                Path("/dev/shm", region).unlink(missing_ok=True)


def wait_gone(repo: Path, limit_s: float = 15) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(map(alive, repo_processes(repo))):
        time.sleep(0.2)


@pytest.fixture
def env1(tmp_path):
    world = Env(tmp_path, tp_size=1)
    yield world
    world.cleanup()


@pytest.fixture
def env2(tmp_path):
    world = Env(tmp_path, tp_size=2)
    yield world
    world.cleanup()


@pytest.fixture(autouse=True)
def _needs_tools():
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.http")


def needs_mpirun():
    if subprocess.run(["sh", "-c", "command -v mpirun"], capture_output=True).returncode != 0:
        pytest.skip("mpirun (openmpi-bin) is not installed")


# --- one rank, foreground ---------------------------------------------------------------------------


def test_one_rank_runs_without_mpirun_and_sigterm_cleans_up(env1):
    proc = env1.start()
    out = env1.wait_ready(proc)
    assert infer(env1.http, "echo", 41) == {"OUT": [41]}
    assert infer(env1.http, "tensorrt_llm") == {"RANK": [-1]}  # no MPI environment: tritonserver ran alone
    assert env1.markers_seen() == {"rank-1-tensorrt_llm", "rank-1-echo"}
    launch = psutil.Process(proc.pid)
    assert "mpirun" not in {p.name() for p in launch.children(recursive=True)}
    shm_base = env1.state()["shm_base"]
    assert shm_regions(shm_base), "the python stubs should hold shared memory while running"

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"HTTP     http://127.0.0.1:{env1.http}" in out
    assert f"gRPC     127.0.0.1:{env1.grpc}" in out and f"http://127.0.0.1:{env1.metrics}/metrics" in out
    env1.assert_clean(shm_base)
    assert list(env1.state_dir.glob("*/state.json")) == []


# --- two ranks, foreground --------------------------------------------------------------------------


def test_two_ranks_under_mpirun_rank0_serves_and_ctrl_c_cleans_up(env2):
    needs_mpirun()
    proc = env2.start("--world-size", "2")
    env2.wait_ready(proc)
    assert infer(env2.http, "tensorrt_llm") == {"RANK": [0]}
    assert infer(env2.http, "echo", 5) == {"OUT": [5]}
    # rank 1 loaded tensorrt_llm only; rank 0 everything
    assert env2.markers_seen() == {"rank0-tensorrt_llm", "rank0-echo", "rank1-tensorrt_llm"}
    names = [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
    assert names.count("mpirun") == 1 and names.count("tritonserver") == 2
    shm_base = env2.state()["shm_base"]
    assert any("rank1_" in name for name in shm_regions(shm_base))

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    env2.assert_clean(shm_base)


@pytest.mark.reliability
def test_a_killed_rank_stops_every_rank_and_shows_its_log(env2):
    needs_mpirun()
    proc = env2.start("--world-size", "2")
    env2.wait_ready(proc)
    shm_base = env2.state()["shm_base"]
    rank1 = [p for p in repo_processes(env2.repo)
             if p.name() == "tritonserver" and "--load-model=tensorrt_llm" in p.cmdline()]
    assert len(rank1) == 1
    killed_at = time.monotonic()
    rank1[0].kill()
    _, err = proc.communicate(timeout=15)
    assert time.monotonic() - killed_at < 15
    assert proc.returncode != 0
    assert "rank 1 of 2 died" in err
    rank1_log = next(env2.state_dir.glob("*/logs/ranks/*/rank.1/stderr"))
    assert f"---- rank 1: {rank1_log} ----" in err
    last_logged = rank1_log.read_text().rstrip().splitlines()[-1].rstrip()
    assert err.rstrip().splitlines()[-2].rstrip() == last_logged  # the log's tail, then the error line
    assert "rank 1 with PID 0 on node" in err and "exited on signal 9 (Killed)" in err  # mpirun's account
    env2.assert_clean(shm_base)


def the_tritonserver(env: Env) -> psutil.Process:
    found = [p for p in repo_processes(env.repo) if p.name() == "tritonserver"]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.reliability
def test_a_tritonserver_that_aborts_reports_its_signal_as_the_watch_reads_it(env1):
    """tritonserver's own crash handler on a real SIGABRT: its line in the rank's stderr is the one the
    supervisor watches for (rank_logs.FATAL_SIGNAL), and the launch stops."""
    proc = env1.start()
    env1.wait_ready(proc)
    shm_base = env1.state()["shm_base"]
    log_dir = Path(env1.state()["log_dir"])
    the_tritonserver(env1).send_signal(signal.SIGABRT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] in (
        f"trtglm: error: rank 0's tritonserver crashed (SIGABRT); stopped all ranks (logs: {log_dir})",
        f"trtglm: error: rank 0 of 1 died (tritonserver received SIGABRT); stopped all ranks (logs: {log_dir})")
    # ^ the handler died first
    assert FatalSignals(log_dir).first() == (0, signal.SIGABRT)
    env1.assert_clean(shm_base)


@pytest.mark.reliability
def test_a_tritonserver_hung_in_its_crash_handler_stops_the_launch(env1):
    """A tritonserver that wrote its crash handler's first line and then hangs (a corrupted heap can hang its
    stack trace for good): stopped, with the others, as a dead rank is. The hang is a SIGSTOP, the line written
    as the handler writes it."""
    proc = env1.start()
    env1.wait_ready(proc)
    shm_base = env1.state()["shm_base"]
    log_dir = Path(env1.state()["log_dir"])
    server = the_tritonserver(env1)
    server.send_signal(signal.SIGSTOP)
    with open(log_dir / "ranks" / "rank.0" / "stderr", "ab") as stderr:
        stderr.write(b"double free or corruption (out)\nSignal (6) received.\n")
    hung_at = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - hung_at < 5
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (f"trtglm: error: rank 0's tritonserver crashed (SIGABRT); stopped all "
                                            f"ranks (logs: {log_dir})")
    assert not alive(server)
    env1.assert_clean(shm_base)


@pytest.mark.reliability
def test_a_crash_after_a_stubs_death_names_the_stub(env1):
    """Triton 2.51's python backend can abort just after one of its stubs is killed; the error names the stub
    that died first. The abort is the handler's line written while the server is stopped (so it reaps nothing)."""
    proc = env1.start()
    env1.wait_ready(proc)
    log_dir = Path(env1.state()["log_dir"])
    server = the_tritonserver(env1)
    stub = next(p for p in server.children() if is_stub(p.cmdline()) and stub_model(p.cmdline()) == "echo")
    server.send_signal(signal.SIGSTOP)
    stub.kill()
    deadline = time.monotonic() + 5
    while stub.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(log_dir / "ranks" / "rank.0" / "stderr", "ab") as stderr:
        stderr.write(b"Signal (6) received.\n")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (f"trtglm: error: rank 0's tritonserver crashed (SIGABRT) after rank 0's "
                                            f"echo's python stub (echo_0_0) (pid {stub.pid}) died; stopped all "
                                            f"ranks (logs: {log_dir})")
    assert not alive(server)


# --- detached --------------------------------------------------------------------------------------


def test_detach_second_launch_models_and_stop(env2):
    needs_mpirun()
    started = env2.run("launch", "--repo", str(env2.repo), "--world-size", "2", *env2.ports(), "--detach",
                       "--timeout", "60")
    assert started.returncode == 0, started.stderr
    assert f"HTTP     http://127.0.0.1:{env2.http}" in started.stdout
    assert http_status(f"http://127.0.0.1:{env2.http}/v2/health/ready") == 200
    shm_base = env2.state()["shm_base"]
    assert env2.state()["status"] == "ready"
    from trtglm.serve.state import shm_files

    assert_listens_on_loopback_alone(env2.repo)
    segments = shm_files(shm_base)
    assert segments and all(path.stat().st_mode & 0o077 == 0 for path in segments), \
        [(path.name, oct(path.stat().st_mode)) for path in segments]  # prompts and replies pass through them

    other_ports = [str(p) for p in free_ports()]
    again = env2.run("launch", "--repo", str(env2.repo), "--world-size", "2", "--http-port", other_ports[0],
                     "--grpc-port", other_ports[1], "--metrics-port", other_ports[2])
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith(f"trtglm: error: {env2.repo} is already being served")

    url = f"http://127.0.0.1:{env2.http}"
    assert_repository_api_needs_the_key(url, f"127.0.0.1:{env2.grpc}", env2.repo.parent)
    listed = env2.run("models", "list", "--url", url)
    assert listed.returncode == 0, listed.stderr
    assert sorted(listed.stdout.splitlines()) == ["echo\t1\tREADY", "tensorrt_llm\t1\tREADY"]
    unloaded = env2.run("models", "unload", "echo", "--url", url)
    assert unloaded.returncode == 0, unloaded.stderr
    deadline = time.monotonic() + 10
    while http_status(f"{url}/v2/models/echo/ready") == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http_status(f"{url}/v2/models/echo/ready") == 400
    loaded = env2.run("models", "load", "echo", "--url", url)
    assert loaded.returncode == 0, loaded.stderr
    assert http_status(f"{url}/v2/models/echo/ready") == 200
    missing = env2.run("models", "load", "no_such_model", "--url", url)
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith("trtglm: error: load no_such_model:")
    assert len(missing.stderr.strip().splitlines()) == 1

    stopped = env2.run("stop")  # the only launch: no --repo needed
    assert stopped.returncode == 0, stopped.stderr
    env2.assert_clean(shm_base)
    assert env2.run("stop").returncode == 2


def assert_listens_on_loopback_alone(repo: Path) -> None:
    """No process of the launch (mpirun, tritonserver, its stubs, their torch.distributed sockets) listens
    beyond loopback."""
    procs = {p.pid: p for p in repo_processes(repo)}
    for proc in list(procs.values()):
        try:
            procs.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.Error:
            pass
    listening = []
    for proc in procs.values():
        try:
            listening += [(proc.name(), c.laddr) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    assert listening and all(addr.ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for _, addr in listening), listening


def http_post(url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with NO_PROXY.open(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def assert_repository_api_needs_the_key(url: str, grpc_address: str, scratch: Path) -> None:
    """Without the launch's key: no load (not even of code sent in the request), no unload, no trace or
    log files, over HTTP and gRPC; the models keep serving."""
    import base64

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    marker = scratch / "code-ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nclass TritonPythonModel:\n    pass\n"
    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                         "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]})
    override = {"parameters": {"config": config, "file:1/model.py": base64.b64encode(code.encode()).decode()}}
    attempts = [(f"{url}/v2/repository/models/evil/load", override), (f"{url}/v2/repository/models/echo/unload", {}),
                (f"{url}/v2/repository/index", {}), (f"{url}/v2/trace/setting", {"trace_file": str(marker)}),
                (f"{url}/v2/logging", {"log_file": str(marker)})]
    for target, body in attempts:
        status, text = http_post(target, body, {"trtglm-api-key": "a guess"})
        assert status in (401, 403), (target, status, text)
    client = grpcclient.InferenceServerClient(grpc_address)
    try:
        for call in (lambda: client.unload_model("echo"), lambda: client.load_model("echo"),
                     lambda: client.get_model_repository_index()):
            with pytest.raises(InferenceServerException, match="(?i)unauthenticated|restricted|header"):
                call()
    finally:
        client.close()
    time.sleep(1)
    assert not marker.exists()
    assert http_status(f"{url}/v2/models/echo/ready") == 200


def test_detached_launch_reports_a_rank_that_fails_to_start(env2):
    needs_mpirun()
    failed = env2.run("launch", "--repo", str(env2.repo), "--world-size", "2", *env2.ports(), "--detach",
                      "--timeout", "60", TEST_FAIL_RANK="0")
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines()[-1].startswith("trtglm: error: rank 0 of 2 died")
    assert "deliberate failure on rank 0" in failed.stderr
    wait_gone(env2.repo)
    assert [p.name() for p in repo_processes(env2.repo) if alive(p)] == []
    assert list(env2.state_dir.glob("*/state.json")) == []


def test_launch_and_stop_clean_up_after_a_dead_supervisor(env1):
    def start_detached_then_kill_supervisor() -> dict:
        started = env1.run("launch", "--repo", str(env1.repo), *env1.ports(), "--detach", "--timeout", "60")
        assert started.returncode == 0, started.stderr
        state = env1.state()
        psutil.Process(state["pid"]).kill()  # the supervisor dies; its server keeps running
        time.sleep(0.5)
        assert http_status(f"http://127.0.0.1:{env1.http}/v2/health/ready") == 200
        return state

    first = start_detached_then_kill_supervisor()
    second = start_detached_then_kill_supervisor()  # same ports: the first server had to go
    assert second["launch_id"] != first["launch_id"]
    assert shm_regions(first["shm_base"]) == []
    stopped = env1.run("stop", "--repo", str(env1.repo))
    assert stopped.returncode == 0, stopped.stderr
    assert "removed what a dead one left" in stopped.stdout
    env1.assert_clean(second["shm_base"])


def test_a_server_not_ready_in_time_is_stopped(env1):
    proc = env1.start("--timeout", "2", TEST_SLOW_ECHO="60")
    _, err = proc.communicate(timeout=40)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("trtglm: error: rank 0 was not ready within 2 s; stopped all ranks")
    wait_gone(env1.repo)
    assert [p.name() for p in repo_processes(env1.repo) if alive(p)] == []


# --- refusals (nothing starts) -------------------------------------------------------------------------


def test_busy_port_is_refused(env1):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", env1.http))
        busy.listen()
        refused = env1.run("launch", "--repo", str(env1.repo), *env1.ports())
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"trtglm: error: --http-port {env1.http} on 127.0.0.1 is in use "
                                      "(pick another port or stop what uses it)")
    assert repo_processes(env1.repo) == []


def test_world_size_mismatch_missing_repo_and_missing_tritonserver_are_refused(env2, tmp_path):
    mismatch = env2.run("launch", "--repo", str(env2.repo), "--world-size", "1", *env2.ports())
    assert mismatch.returncode == 2
    assert mismatch.stderr.strip().startswith("trtglm: error: --world-size 1 does not match the engine's tp × pp = 2")
    missing = env2.run("launch", "--repo", str(tmp_path / "nope"))
    assert missing.returncode == 3
    assert missing.stderr.strip() == f"trtglm: error: model repository {tmp_path / 'nope'}: not a folder"
    (tmp_path / "empty" / "ensemble").mkdir(parents=True)
    empty = env2.run("launch", "--repo", str(tmp_path / "empty"), *env2.ports())
    assert empty.returncode == 3
    assert empty.stderr.strip() == (f"trtglm: error: model repository {tmp_path / 'empty'}: no model in it "
                                    "(no */config.pbtxt); render one with `trtglm patch-repo`")
    no_server = env2.run("launch", "--repo", str(env2.repo), "--tritonserver", str(tmp_path / "tritonserver"))
    assert no_server.returncode == 6
    assert "not an executable file" in no_server.stderr
    assert len(no_server.stderr.strip().splitlines()) == 1


def test_stop_without_repo_needs_exactly_one_running_launch(env1):
    from trtglm.serve.state import LaunchDir

    held = []
    for name in ("a", "b"):
        launch_dir = LaunchDir(env1.state_dir / name)
        held.append(launch_dir.try_lock())  # this test process plays two live supervisors
        launch_dir.write({"repo": f"/repos/{name}", "pid": os.getpid(), "status": "ready"})
    try:
        several = env1.run("stop")
        assert several.returncode == 2
        assert several.stderr.strip() == "trtglm: error: 2 launches are running (/repos/a, /repos/b): pass --repo"
    finally:
        for handle in held:
            handle.close()
    none = env1.run("stop")  # both are stale now: cleaned, and nothing runs
    assert none.returncode == 2
    assert none.stderr.strip() == "trtglm: error: no launch is running"
    assert list(env1.state_dir.glob("*/state.json")) == []


def test_the_wait_shows_the_engines_phase_and_its_time(tmp_path, monkeypatch):
    phase_file = tmp_path / "phase.json"
    monkeypatch.setenv(PHASE_FILE, str(phase_file))
    bar = tqdm(disable=True, bar_format="{desc}")
    show_phase(bar, phase_file, time.monotonic())
    assert bar.desc == "starting tritonserver"
    report_phase("kernels: compiling and tuning (minutes)")
    show_phase(bar, phase_file, time.monotonic())
    assert bar.desc == "starting tritonserver: kernels: compiling and tuning (minutes) (0 s)"
    phase_file.write_text("{not json")
    assert read_phase(phase_file) is None
