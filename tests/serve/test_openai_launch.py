"""The OpenAI-compatible API as part of a launch of the fixture's engine: it answers once launch reports ready,
`trtglm status` counts it, a Triton failure is a 500 that the API survives, its death stops the launch as a
rank's death does, `trtglm stop` stops it, and `--no-openai` serves none."""

from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest
from conftest import repo_processes
from support.servers import Launched

from trtglm.serve.openai_process import API_MODULE

pytestmark = pytest.mark.slow

BODY = {"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": "What color is grass?"}]}


def chat(launched: Launched) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=60) as http:
        return http.post(f"{launched.openai}/chat/completions", json=BODY)


def api_process(launched: Launched) -> psutil.Process:
    [api] = [p for p in repo_processes(launched.repo) if API_MODULE in p.cmdline()]
    return api


def supervisor_log(launched: Launched) -> str:
    return (next((launched.root / "state").glob("*/logs")) / "supervisor.log").read_text()


def state(launched: Launched) -> dict | None:
    found = list((launched.root / "state").glob("*/state.json"))
    return json.loads(found[0].read_text()) if found else None


@pytest.fixture
def launched(tmp_path):
    server = Launched(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_the_api_is_part_of_the_launch_until_stop(launched):
    assert chat(launched).json()["choices"][0]["message"]["content"] == "Grass is green."
    recorded = state(launched)
    assert recorded["urls"]["openai"] == launched.openai and recorded["openai_pid"] == api_process(launched).pid
    [line] = launched.run("status").stdout.splitlines()
    assert f"openai={launched.ports['openai']}" in line and line.endswith("\tready")

    unloaded = launched.run("models", "unload", "ensemble", "--url", launched.url)
    assert unloaded.returncode == 0, unloaded.stderr
    failed = chat(launched)
    error = failed.json()["error"]
    assert failed.status_code == 500 and error["type"] == "server_error" and "ensemble" in error["message"]
    assert launched.run("models", "load", "ensemble", "--url", launched.url).returncode == 0
    # loading the ensemble reloads the models it is made of; their old stubs' exits are no deaths to restart
    assert chat(launched).json()["choices"][0]["message"]["content"] == "Grass is green."
    assert "python process died" not in supervisor_log(launched)

    api = api_process(launched)
    stopped = launched.run("stop", "--repo", str(launched.repo), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not api.is_running() and repo_processes(launched.repo) == []


def test_the_apis_death_stops_the_launch(launched):
    api = api_process(launched)
    api.kill()
    deadline = time.monotonic() + 60
    while (repo_processes(launched.repo) or state(launched)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert repo_processes(launched.repo) == [] and state(launched) is None
    log = supervisor_log(launched)
    assert f"trtglm: error: the OpenAI API (pid {api.pid}) exited with status -9; stopped all ranks" in log


def test_no_openai_serves_none(tmp_path):
    server = Launched(tmp_path, launch_flags=("--no-openai",))
    try:
        server.start()
        assert "openai" not in state(server)["ports"]
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", server.ports["openai"])) != 0
        assert not [p for p in repo_processes(server.repo) if API_MODULE in p.cmdline()]
    finally:
        server.stop()
