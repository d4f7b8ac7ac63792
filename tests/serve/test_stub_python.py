"""The python backend's stubs under numpy 2 (the machines whose Python ships it, e.g. a GPU
image's torch venv), against real tritonserver processes (nvidia-pytriton's binary, CPU).

nvidia-pytriton's stubs are built for numpy 1: under numpy 2 every BYTES input reaches the
model as its first byte repeated. These tests reproduce that with Triton alone, then show that
`trtglm launch` run from a numpy 2 environment serves the fixture's exact answers (its stubs
get numpy < 2, installed by an offline pip from a local wheel), and that a launch whose models
cannot answer fails with one line instead of saying it serves.

numpy 2 and the local numpy 1 wheel come from scripts/setup.sh (`.venv/numpy2`, `.venv/wheels`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_ports, kill_repo_processes, repo_processes
from support.servers import Launched, fixture_answers

pytestmark = pytest.mark.slow

VENV = Path(sys.prefix)
NUMPY2 = VENV / "numpy2"
WHEELS = VENV / "wheels"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

ECHO_CONFIG = '''name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TEXT_OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
'''
ECHO_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT_OUT", text.astype(np.object_))]))
        return out
'''
FAILING_PREPROCESSING = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("deliberate preprocessing failure")
'''


@pytest.fixture(autouse=True)
def _needs_numpy2():
    if not (NUMPY2 / "numpy").is_dir() or not list(WHEELS.glob("numpy-1.*.whl")):
        pytest.skip(f"{NUMPY2} or a numpy 1 wheel in {WHEELS} is missing (run scripts/setup.sh)")


def post_json(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with NO_PROXY.open(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def echo_through_stubs(root: Path, numpy_first: Path | None) -> tuple[int, dict, str]:
    """Serve the echo model with stubs whose path starts with `numpy_first`; ask it once (JSON, BYTES).
    The status and body of the answer, and the server's log."""
    from trtglm.serve.stub_python import _make_venv, launch_paths
    from trtglm.serve.tritonserver import backend_directory, find_tritonserver, server_env

    repo = root / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    stub_env = root / "stub-env"
    _make_venv(stub_env, [str(p) for p in (numpy_first,) if p] + launch_paths())
    binary = find_tritonserver(None)
    http, grpc, metrics = free_ports(3)
    env = server_env(dict(os.environ), "test", str(stub_env / "bin"))
    log_path = root / "server.log"
    server = subprocess.Popen([str(binary), f"--model-repository={repo}", f"--backend-directory={backend_directory(binary)}",
                               f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
                               "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--exit-timeout-secs=2"],
                              env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if NO_PROXY.open(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        text = "twenty-six bytes of text!!"
        status, body = post_json(f"http://127.0.0.1:{http}/v2/models/echo/infer",
                                 {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [text]}]})
    finally:
        server.terminate()
        try:
            server.wait(15)
        finally:
            kill_repo_processes(repo)
    return status, body, log_path.read_text(errors="replace")


def test_numpy2_in_the_stubs_corrupts_every_string_input(tmp_path):
    """The cause, with Triton alone: the same request answers under numpy 1 and kills the stub under numpy 2,
    whose copy of the input holds the length's low byte four times (26 bytes: 0x1A1A1A1A)."""
    status, body, _ = echo_through_stubs(tmp_path / "numpy1", None)
    assert (status, body["outputs"][0]["data"]) == (200, ["twenty-six bytes of text!!"]), body
    status, body, log = echo_through_stubs(tmp_path / "numpy2", NUMPY2)
    assert status >= 400 and "Stub process 'echo_0_0' is not healthy" in body["error"], body
    length = int.from_bytes(bytes([26] * 4), "little")  # 0x1A1A1A1A
    assert f"unpack_from requires a buffer of at least {length + 4} bytes for unpacking {length} bytes" in log


def test_launch_from_a_numpy2_environment_serves_exact_answers(tmp_path):
    """launch's own numpy is 2 (first on PYTHONPATH); pip may only use the local wheel folder."""
    server = Launched(tmp_path)
    server.env.update(PYTHONPATH=str(NUMPY2), XDG_CACHE_HOME=str(tmp_path / "cache"), PIP_NO_INDEX="1",
                      PIP_FIND_LINKS=str(WHEELS))
    try:
        server.start()
        answers = fixture_answers()
        for model in ("ensemble", "tensorrt_llm_bls"):
            question = "What is the capital of France?"
            status, body = post_json(f"{server.url}/v2/models/{model}/generate",
                                     {"text_input": question, "max_tokens": 48})
            assert (status, body["text_output"]) == (200, answers[question]), body
        installed = list((tmp_path / "cache" / "trtglm").glob("numpy1-py*/numpy-1.*.dist-info"))
        assert len(installed) == 1, installed
    finally:
        server.stop()
    assert not repo_processes(server.repo)


def test_launch_fails_in_one_line_when_a_model_cannot_answer(tmp_path):
    """Models that load but fail every request: launch stops everything and names the model and the error."""
    server = Launched(tmp_path)
    server.render()
    (server.repo / "preprocessing" / "1" / "model.py").write_text(FAILING_PREPROCESSING)
    done = server.launch()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "serving" not in done.stdout, (done.stdout, done.stderr)
    assert last.startswith("trtglm: error: ensemble failed its first request at launch (") and \
        "deliberate preprocessing failure" in last and last.endswith(")"), last
    assert not repo_processes(server.repo)


def test_the_stub_environment_runs_its_site_hooks_without_error(tmp_path):
    """The venv's .pth adds launch's path and runs the site folders' own .pth hooks, quietly."""
    from trtglm.serve import stub_python

    hooked = tmp_path / "hooked"
    hooked.mkdir()
    (hooked / "marker.pth").write_text(str(tmp_path / "from-hook") + "\n")
    (tmp_path / "from-hook").mkdir()
    real = stub_python._site_dirs
    stub_python._site_dirs = lambda: [str(hooked)]
    try:
        stub_python._make_venv(tmp_path / "env", [str(hooked)])
    finally:
        stub_python._site_dirs = real
    done = subprocess.run([str(tmp_path / "env" / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert str(tmp_path / "from-hook") in done.stdout.splitlines()
