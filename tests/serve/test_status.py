"""`trtglm status`, `trtglm logs` and `trtglm launch … -- FLAGS` against a real launched server of the fixture."""

import json

import pytest

from conftest import repo_processes
from support.servers import Launched

PASSED_ON = "--log-info=true"  # tritonserver's own flag, its default: harmless, and visible in its argv


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    server = Launched(tmp_path_factory.mktemp("status"), server_flags=(PASSED_ON,))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_flags_after_double_dash_reach_tritonserver(launched):
    servers = [p for p in repo_processes(launched.repo) if p.name() == "tritonserver"]
    assert len(servers) == 1
    assert servers[0].cmdline()[-1] == PASSED_ON


def test_status_shows_the_launch_ready_with_its_ports(launched):
    done = launched.run("status")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    state = json.loads(next((launched.root / "state").glob("*/state.json")).read_text())
    ports = " ".join(f"{name}={port}" for name, port in launched.ports.items())
    assert line.split("\t") == [str(launched.repo), "ready", f"pid {state['pid']}", ports, "ready"]


def test_logs_show_the_tail_of_rank_0_and_the_supervisor(launched):
    done = launched.run("logs", "--lines", "400")
    assert done.returncode == 0, done.stderr
    files = [line[len("==> "):-len(" <==")] for line in done.stdout.splitlines() if line.startswith("==> ")]
    assert ["/".join(path.split("/")[-2:]) for path in files] == ["rank.0/stderr", "rank.0/stdout",
                                                                  "logs/supervisor.log", "logs/openai.log"]
    assert "Started HTTPService at" in done.stdout
    assert f"OpenAI API for tiny (ensemble over 127.0.0.1:{launched.ports['grpc']})" in done.stdout
    short = launched.run("logs", "--lines", "2")
    sections = short.stdout.split("==> ")[1:]
    assert all(len(section.strip().splitlines()) <= 3 for section in sections)  # header + at most 2 lines
    missing = launched.run("logs", "--repo", str(launched.root / "elsewhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "no launch of" in missing.stderr and "is recorded" in missing.stderr


def test_logs_of_a_rank_or_replica_the_launch_lacks_are_one_line(launched):
    for flags, words in ((("--rank", "99"), "--rank 99: the launch has 1 rank(s) (0 to 0)"),
                         (("--replica", "1"), "runs one replica: --replica can only be 0")):
        done = launched.run("logs", *flags)
        assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_status_json_lists_the_launch_as_one_replica(launched):
    done = launched.run("status", "--json")
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert (row["repo"], row["state"], row["ready"], row["front"]) == (str(launched.repo), "ready", True, False)
    assert row["replicas"] == [{"index": 0, "gpus": None, "state": "ready", "ports": launched.ports, "restarts": 0,
                                "reason": None}]
