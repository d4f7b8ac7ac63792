"""Launched servers for end-to-end tests: `Launched` builds the fixture's engine and repository and
launches it (`launched_server` for module fixtures); `Server` launches a given repository at a
given world size and talks HTTP, gRPC and metrics to it. Both stop with `trtglm stop`."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURE, REPO, free_ports, kill_repo_processes, repo_processes

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixture_answers() -> dict[str, str]:
    conversations = [json.loads(line) for line in (FIXTURE / "conversations.jsonl").read_text().splitlines()]
    return {c["messages"][0]["content"]: c["answer"] for c in conversations if len(c["messages"]) == 1}


class Launched:
    """The fixture's torch engine (`build_flags`: e.g. `--set` overrides of configs/tiny.yaml), its rendered
    repository and a detached `trtglm launch` of it (`profile_ports`: Triton's ports set in the profile, not
    given to `launch`)."""

    def __init__(self, root: Path, server_flags: tuple[str, ...] = (), launch_flags: tuple[str, ...] = (),
                 build_flags: tuple[str, ...] = (), profile_ports: bool = False):
        self.root, self.repo, self.server_flags = root, root / "repo", server_flags
        # below the ephemeral range: the clients' own connections (the OpenAI API's to Triton too) never take them
        self.ports = dict(zip(("http", "grpc", "metrics", "openai"), free_ports(4)))
        self.flagged_ports = ("openai",) if profile_ports else tuple(self.ports)
        profile_sets = [("--set", f"serve.{name}_port={port}") for name, port in self.ports.items()
                        if name not in self.flagged_ports]
        self.launch_flags, self.build_flags = launch_flags, (*build_flags, *(arg for pair in profile_sets
                                                                              for arg in pair))
        self.env = {**os.environ, "TRTGLM_STATE_DIR": str(root / "state"), "PYTHONUNBUFFERED": "1"}
        self.url = f"http://127.0.0.1:{self.ports['http']}"
        self.grpc = f"127.0.0.1:{self.ports['grpc']}"
        self.metrics = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        self.openai = f"http://127.0.0.1:{self.ports['openai']}/v1"

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trtglm", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=REPO, env=self.env)

    def render(self) -> None:
        """Build the engine and render its repository (a test may change it before `launch`)."""
        engine = self.root / "engine"
        for args in (("build-engine", "--config", "configs/tiny.yaml", "--output-dir", str(engine), *self.build_flags),
                     ("patch-repo", "--engine-dir", str(engine), "--output-repo", str(self.repo))):
            self._check(args, self.run(*args))

    def launch(self) -> subprocess.CompletedProcess:
        """A detached `trtglm launch` of the rendered repository, on the test's ports."""
        return self.run("launch", "--repo", str(self.repo), "--detach", "--timeout", "180",
                        *(f"--{name}-port={self.ports[name]}" for name in self.flagged_ports), *self.launch_flags,
                        *(("--", *self.server_flags) if self.server_flags else ()))

    def start(self) -> None:
        self.render()
        self._check(("launch",), self.launch())

    @staticmethod
    def _check(args: tuple[str, ...], done: subprocess.CompletedProcess) -> None:
        if done.returncode != 0:
            raise AssertionError(f"trtglm {args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")

    def stop(self) -> None:
        self.run("stop", "--repo", str(self.repo), timeout=120)


def launched_server(root: Path, build_flags: tuple[str, ...] = (), profile_ports: bool = False,
                    launch_flags: tuple[str, ...] = ()):
    """Generator for module fixtures: a launched server, always stopped."""
    server = Launched(root, build_flags=build_flags, profile_ports=profile_ports, launch_flags=launch_flags)
    try:
        server.start()
        yield server
    finally:
        server.stop()


class Server:
    """A detached `trtglm launch` of one repository, stopped with `trtglm stop`."""

    def __init__(self, repo: Path, world: int, state_dir: Path, extra_env: dict[str, str] | None = None,
                 launch_flags: tuple[str, ...] = ()):
        self.repo, self.world = repo, world
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = free_ports(4)
        self.env = {**os.environ, "TRTGLM_STATE_DIR": str(state_dir), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        started = self.cli("launch", "--repo", str(repo), "--world-size", str(world), "--detach", "--timeout", "180",
                           "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                           "--metrics-port", str(self.metrics_port), "--openai-port", str(self.openai_port),
                           *launch_flags, timeout=300)
        if started.returncode != 0:
            self.kill_leftovers()
            pytest.fail(f"launch failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
        self.state = json.loads(next(state_dir.glob("*/state.json")).read_text())

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trtglm", *args], capture_output=True, text=True, cwd=REPO,
                              env=self.env, timeout=timeout)

    def stop(self) -> None:
        stopped = self.cli("stop", "--repo", str(self.repo))
        left = [(p.pid, p.name()) for p in repo_processes(self.repo)]
        self.kill_leftovers()
        assert stopped.returncode == 0, stopped.stderr
        assert left == [], f"left running after stop: {left}"
        assert not list(Path("/dev/shm").glob(f"{self.state['shm_base']}*"))

    def kill_leftovers(self) -> None:
        kill_repo_processes(self.repo)

    # --- HTTP ------------------------------------------------------------------------------------------

    def post(self, path: str, data: bytes, timeout: float = 60) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with NO_PROXY.open(request, timeout=timeout) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status(self, path: str) -> int:
        try:
            with NO_PROXY.open(f"http://127.0.0.1:{self.http_port}{path}", timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as e:
            return e.code

    def generate(self, model: str, body: dict) -> tuple[int, dict]:
        status, text = self.post(f"/v2/models/{model}/generate", json.dumps(body).encode())
        return status, json.loads(text)

    def stream(self, model: str, body: dict) -> tuple[int, list[dict]]:
        status, text = self.post(f"/v2/models/{model}/generate_stream", json.dumps({**body, "stream": True}).encode())
        return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]

    def metrics(self) -> dict[str, float]:
        with NO_PROXY.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("trtglm_")}

    # --- gRPC ------------------------------------------------------------------------------------------

    def grpc_stream(self, model: str, inputs: dict[str, np.ndarray], read: int | None = None) -> list:
        """The responses of one streamed request (until the final one, or the first `read` then cancel)."""
        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        tensors = []
        for name, array in inputs.items():
            tensor = grpc.InferInput(name, list(array.shape), triton_type(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        responses = []
        try:
            while read is None or len(responses) < read:
                result, error = results.get(timeout=60)
                assert error is None, error
                responses.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream(cancel_requests=read is not None)
            client.close()
        return responses


def triton_type(array: np.ndarray) -> str:
    return {np.object_: "BYTES", np.int32: "INT32", np.bool_: "BOOL", np.float32: "FP32"}[array.dtype.type]
