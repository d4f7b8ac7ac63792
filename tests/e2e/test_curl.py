"""scripts/curl_tests.sh against a launched server of the fixture's engine (world size 1): every
check passes; with a wrong expected answer and an unreachable metrics endpoint the checks that
depend on them fail (with their reasons) and the script exits non-zero."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import REPO
from support.servers import NO_PROXY, free_port, launched_server

from trtglm.files import read_phase

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "curl_tests.sh"
CHECKS = ["health ready", "ensemble generate", "ensemble generate_stream", "tensorrt_llm_bls generate",
          "tensorrt_llm_bls generate_stream", "metrics", "error: missing text_input", "error: max_tokens -1",
          "error: prompt over max_input_len", "error: malformed JSON"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Launched on the ports its profile names (`serve.*_port`, none of them 8000-8002), no port flag given."""
    yield from launched_server(tmp_path_factory.mktemp("curl-served"), profile_ports=True)


def curl_tests(url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), url], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_the_launch_serves_on_its_profiles_ports(served):
    state = json.loads(next((served.root / "state").glob("*/state.json")).read_text())
    assert state["ports"] == served.ports
    assert urllib_status(f"{served.url}/v2/health/ready") == 200
    assert urllib_status(served.metrics) == 200
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(served.grpc)
    try:
        assert client.is_model_ready("ensemble")
    finally:
        client.close()


def urllib_status(url: str) -> int:
    with NO_PROXY.open(url, timeout=30) as reply:
        return reply.status


def test_without_a_launch_serving_the_url_the_metrics_check_says_to_name_it(served):
    elsewhere = curl_tests(served.url, TRTGLM_STATE_DIR=str(served.root / "no-launches"))
    assert results(elsewhere.stdout)["metrics"] == (f"FAIL: no trtglm launch serves {served.url} "
                                                    f"(state in {served.root / 'no-launches'}): set METRICS_URL")


def results(stdout: str) -> dict[str, str]:
    """{check name: "PASS" or "FAIL: reason"} from the script's lines."""
    out = {}
    for line in stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        name = next((c for c in CHECKS if rest == c or rest.startswith((c + " (", c + ":"))), rest)
        out[name] = verdict if verdict == "PASS" else f"{verdict}{rest[len(name):]}"
    return out


def test_every_check_passes(served):
    done = curl_tests(served.url, TRTGLM_STATE_DIR=str(served.root / "state"))  # the metrics URL: the launch's
    lines = done.stdout.splitlines()
    assert all(line.startswith("PASS ") for line in lines), done.stdout
    assert list(results(done.stdout)) == CHECKS
    assert done.returncode == 0, done.stderr


def test_a_chinese_question_passes_too(served):
    done = curl_tests(served.url, METRICS_URL=served.metrics, PROMPT="中国的首都是哪里？", EXPECT="中国的首都是北京。")
    assert done.returncode == 0, done.stdout


def test_broken_expectations_fail_with_reasons(served):
    done = curl_tests(served.url, EXPECT="The capital of France is Rome.",
                      METRICS_URL=f"http://127.0.0.1:{free_port()}/metrics")
    assert done.returncode == 1
    got = results(done.stdout)
    assert list(got) == CHECKS
    wrong = "answer 'The capital of France is Paris.', expected 'The capital of France is Rome.'"
    assert got["ensemble generate"] == f"FAIL: {wrong}"
    assert got["tensorrt_llm_bls generate"] == f"FAIL: {wrong}"
    assert got["tensorrt_llm_bls generate_stream"].startswith("FAIL: joined text 'The capital of France is Paris.'")
    assert got["metrics"].startswith("FAIL: http://127.0.0.1:") and "no answer" in got["metrics"]
    assert got["health ready"] == "PASS" and got["error: malformed JSON"] == "PASS"


def test_an_unreachable_server_fails_every_check(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    done = curl_tests(url, TRTGLM_STATE_DIR=str(tmp_path))
    assert done.returncode == 1
    got = results(done.stdout)
    assert list(got) == CHECKS
    assert got.pop("metrics") == f"FAIL: no trtglm launch serves {url} (state in {tmp_path}): set METRICS_URL"
    assert all(verdict.startswith("FAIL: ") and "no answer" in verdict for verdict in got.values()), done.stdout


def test_the_launch_followed_the_engines_start_by_its_phases(served):
    """The engine said its phases as it started (weights, warm-up, ready); the launch's wait shows the last one."""
    phase = read_phase(next((served.root / "state").glob("*/phase.json")))
    assert phase is not None and phase[0] == "engine ready; Triton loads the other models", phase
