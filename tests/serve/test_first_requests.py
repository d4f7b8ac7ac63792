"""Launch's first requests: before it reports ready, the supervisor asks every model clients ask that the
repository has (ensemble, tensorrt_llm_bls and the history model chatglm3-6b, with the inputs its config
declares) and logs how long each took; a history model that loads but cannot answer fails the launch with
one line naming it and its error, and leaves nothing running."""

from __future__ import annotations

import re

import pytest
from conftest import repo_processes
from support.servers import Launched

pytestmark = pytest.mark.slow

HISTORY_MODEL = "chatglm3-6b"
FAILING_HISTORY = '''
class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("deliberate history model failure")
'''


def supervisor_log(launched: Launched) -> str:
    return (next((launched.root / "state").glob("*/logs")) / "supervisor.log").read_text()


def test_the_history_model_answers_before_launch_reports_ready(tmp_path):
    launched = Launched(tmp_path)
    try:
        launched.start()
        log = supervisor_log(launched)
    finally:
        launched.stop()
    for model in ("ensemble", "tensorrt_llm_bls", HISTORY_MODEL):
        assert re.search(rf": {re.escape(model)} answered a first request in \d+\.\d\d s$", log, re.M), log


def test_a_broken_history_model_fails_the_launch_in_one_line(tmp_path):
    launched = Launched(tmp_path)
    launched.render()
    (launched.repo / HISTORY_MODEL / "1" / "model.py").write_text(FAILING_HISTORY)
    done = launched.launch()
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "serving" not in done.stdout, (done.stdout, done.stderr)
    assert last.startswith(f"trtglm: error: {HISTORY_MODEL} failed its first request at launch ({HISTORY_MODEL}: ") \
        and "deliberate history model failure" in last and "stopped all ranks" in last, last
    assert not repo_processes(launched.repo)
