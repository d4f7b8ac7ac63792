"""scripts/curl_tests.sh against a launched server of the fixture's engine (world size 1): every
check passes; with a wrong expected answer and an unreachable metrics endpoint the checks that
depend on them fail (with their reasons) and the script exits non-zero."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO
from support.servers import free_port, launched_server

from trtglm.files import read_phase

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "curl_tests.sh"
CHECKS = ["health ready", "ensemble generate", "ensemble generate_stream", "tensorrt_llm_bls generate",
          "tensorrt_llm_bls generate_stream", "metrics", "error: missing text_input", "error: max_tokens -1",
          "error: prompt over max_input_len", "error: malformed JSON"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from launched_server(tmp_path_factory.mktemp("curl-served"))


def curl_tests(url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), url], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def results(stdout: str) -> dict[str, str]:
    """{check name: "PASS" or "FAIL: reason"} from the script's lines."""
    out = {}
    for line in stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        name = next((c for c in CHECKS if rest == c or rest.startswith((c + " (", c + ":"))), rest)
        out[name] = verdict if verdict == "PASS" else f"{verdict}{rest[len(name):]}"
    return out


def test_every_check_passes(served):
    done = curl_tests(served.url, METRICS_URL=served.metrics)
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


def test_an_unreachable_server_fails_every_check():
    done = curl_tests(f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 1
    got = results(done.stdout)
    assert list(got) == CHECKS
    assert all(verdict.startswith("FAIL: ") and "no answer" in verdict for verdict in got.values()), done.stdout


def test_the_launch_followed_the_engines_start_by_its_phases(served):
    """The engine said its phases as it started (weights, warm-up, ready); the launch's wait shows the last one."""
    phase = read_phase(next((served.root / "state").glob("*/phase.json")))
    assert phase is not None and phase[0] == "engine ready; Triton loads the other models", phase
