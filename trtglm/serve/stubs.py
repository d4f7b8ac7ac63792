"""Rank 0's python-backend stubs, watched: a model whose stub died is restarted.

Triton 2.51 neither restarts a python model whose stub process died nor stops calling it ready:
every later request gets "Stub process 'MODEL_0_0' is not healthy" (or waits forever) while
/v2/health/ready says 200. The supervisor looks at rank 0's stubs every poll; when one has gone
while Triton still reports its model ready UNLOADING_S later (a model unloaded on purpose is not), it
unloads and loads that model again through the repository API (with the launch's secret), which
starts a new stub in well under a second for pre/postprocessing and BLS, and reloads the engine
for `tensorrt_llm`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from trtglm.errors import TrtglmError
from trtglm.serve.command import API_KEY_HEADER
from trtglm.serve.tritonserver import STUB

log = logging.getLogger(__name__)

UNLOAD_WAIT_S = 30.0
UNLOADING_S = 2.0  # a model unloaded on purpose stops being ready within this long of its stub's exit
LOAD_TIMEOUT_S = 600.0  # the engine's model reloads its weights (and on a GPU its kernels)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def stub_instances(server: psutil.Process) -> dict[int, tuple[str, str]]:
    """pid → (model, instance) of the live python-backend stubs that `server` (a tritonserver) started."""
    found = {}
    try:
        children = server.children()
    except psutil.Error:
        return found
    for child in children:
        try:
            args = child.cmdline()
            if len(args) > 8 and os.path.basename(args[0]) == STUB and child.status() != psutil.STATUS_ZOMBIE:
                # argv: model.py (REPO/MODEL/VERSION/model.py), shm region, sizes, parent, lib dir, ipc, instance
                found[child.pid] = (Path(args[1]).parent.parent.name, args[8])
        except psutil.Error:
            continue
    return found


class StubWatch:
    """The models whose stubs died since the last look. A stub whose instance runs again under a new
    stub did not die: Triton reloading a model (its own `load`, or an ensemble's load reloading the
    models it is made of) starts the new stubs before the old ones exit."""

    def __init__(self):
        self.known: dict[int, tuple[str, str]] = {}

    def died(self, server: psutil.Process) -> set[str]:
        now = stub_instances(server)
        running = set(now.values())
        dead = {model for pid, (model, instance) in self.known.items()
                if pid not in now and (model, instance) not in running}
        self.known = now
        return dead


def died_while_ready(url: str, model: str) -> bool:
    """Whether Triton still calls `model` ready UNLOADING_S after its stub exited (a crash), rather than
    letting it go (an unload, whose stub exits before Triton's readiness changes)."""
    deadline = time.monotonic() + UNLOADING_S
    while time.monotonic() < deadline:
        if not model_ready(url, model):
            return False
        time.sleep(0.1)
    return model_ready(url, model)


def model_ready(url: str, model: str) -> bool:
    try:
        with _NO_PROXY.open(f"{url}/v2/models/{model}/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def restart_model(url: str, model: str, api_key: str | None) -> None:
    """Unload `model`, wait until Triton has let it go, load it again; TrtglmError when Triton refuses."""
    _repository(url, model, "unload", api_key, UNLOAD_WAIT_S)
    deadline = time.monotonic() + UNLOAD_WAIT_S
    while model_ready(url, model) and time.monotonic() < deadline:
        time.sleep(0.05)
    _repository(url, model, "load", api_key, LOAD_TIMEOUT_S)
    if not model_ready(url, model):
        raise TrtglmError(f"{model} is not ready after loading it again")


def _repository(url: str, model: str, action: str, api_key: str | None, timeout: float) -> None:
    headers = {"Content-Type": "application/json", **({API_KEY_HEADER: api_key} if api_key else {})}
    request = urllib.request.Request(f"{url}/v2/repository/models/{model}/{action}", data=b"{}", headers=headers,
                                     method="POST")
    try:
        with _NO_PROXY.open(request, timeout=timeout):
            return
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except ValueError:
            message = ""
        raise TrtglmError(f"{action} {model}: HTTP {e.code} {message}".strip()) from None
    except OSError as e:
        raise TrtglmError(f"{action} {model}: {e}") from None
