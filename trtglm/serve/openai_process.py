"""The OpenAI-compatible API's process in a launch (trtglm/openai_api/): started by the supervisor once Triton
is ready, answering its /health before the launch reports ready, watched with the ranks (its death stops
the launch) and stopped first. Its command line carries the launch's shm base, as every process of a
launch does, so that the remains of a dead launch include it (state.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trtglm.processes import NOT_READY_SIGNAL, stop_child
from trtglm.serve.command import Endpoints, client_host
from trtglm.serve.rank_logs import ERROR_LINE, read_log

LOG_NAME = "openai.log"
API_MODULE = "trtglm.openai_api"  # run with python -m
START_TIMEOUT_S = 60.0


def api_args(repo: str, endpoints: Endpoints, shm_base: str, drain_s: float) -> list[str]:
    """The API's command line (this Python): Triton's metrics on its port too, `drain_s` for its answers under way
    when it is stopped."""
    urls = endpoints.urls()
    return [sys.executable, "-m", API_MODULE, "--repo", repo, "--grpc", urls["grpc"], "--host", endpoints.host,
            "--port", str(endpoints.openai_port), "--metrics", urls["metrics"], "--graceful", f"{drain_s:g}",
            "--launch", shm_base]


class OpenAIProcess:
    def __init__(self, repo: str, endpoints: Endpoints, shm_base: str, log_dir: Path, drain_s: float):
        self.argv = api_args(repo, endpoints, shm_base, drain_s)
        self.log_path = log_dir / LOG_NAME
        self.health = f"http://{client_host(endpoints.host)}:{endpoints.openai_port}/health"
        self.popen: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, stopping: Callable[[], bool], answers: Callable[[str], bool],
                   limit_s: float = START_TIMEOUT_S) -> str | None:
        """None once `answers` its /health URL (or a stop was asked for); else why it did not start."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not stopping():
            if self.popen.poll() is not None:
                return f"the OpenAI API exited with status {self.popen.returncode}{self._cause()}"
            if answers(self.health):
                return None
            time.sleep(0.2)
        return None if stopping() else f"the OpenAI API did not answer within {limit_s:g} s{self._cause()}"

    def not_ready(self) -> None:
        """Tell the API that the launch stops: its /health stops answering 200 at once."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(NOT_READY_SIGNAL)

    def died(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None

    def stop(self, grace_s: float) -> None:
        stop_child(self.popen, grace_s)

    def _cause(self) -> str:
        errors = [line.strip().removeprefix("trtglm: ") for line in read_log(self.log_path).splitlines()
                  if ERROR_LINE.match(line.strip().removeprefix("trtglm: "))]
        return f" ({errors[-1]})" if errors else ""

