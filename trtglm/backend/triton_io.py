"""What trtglm's Triton python models share: the backend's utilities, parameters, tensors, errors,
and whether another python model of the same server still runs (`ModelProcesses`).

`triton_python_backend_utils` exists only inside a Triton python-backend process; elsewhere
(tests) `pb_utils` is None and only the plain functions are used.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import psutil

from trtglm.backend.contract import STUB, TOKENIZER_DIR, int_parameter, parameter  # int_parameter: the models' too
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import TrtglmError, UsageError
from trtglm.processes import alive

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # not inside Triton
    pb_utils = None

log = logging.getLogger(__name__)


def initialize_config(args: Mapping) -> dict:
    """The model's configuration as `initialize(args)` receives it (JSON text)."""
    return json.loads(args["model_config"])


@dataclass(frozen=True)
class Setup:
    """What `initialize(args)` gives a model: its configuration, its parameters and its name."""

    config: dict
    params: dict[str, str]
    name: str

    def parameter(self, key: str) -> str:
        return parameter(self.params, key, self.name)

    def tokenizer(self) -> ChatGLMTokenizer:
        return ChatGLMTokenizer(self.parameter(TOKENIZER_DIR))


def setup(args: Mapping, default_name: str) -> Setup:
    # A stub that dies of a signal otherwise leaves nothing in the rank's log: this writes every thread's
    # Python stack there first.
    faulthandler.enable(all_threads=True)
    config = initialize_config(args)
    return Setup(config, config_parameters(config), config.get("name", default_name))


def config_parameters(config: Mapping) -> dict[str, str]:
    """`parameters { key: ..., value { string_value: ... } }` as {key: value}."""
    return {key: entry.get("string_value", "") for key, entry in config.get("parameters", {}).items()}


def bool_parameter(params: Mapping[str, str], key: str, model: str) -> bool:
    value = parameter(params, key, model).strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise UsageError(f"{model}: parameter {key} must be true or false, not {value!r}")
    return value in ("true", "1")


def output_dtypes(config: Mapping) -> dict[str, np.dtype]:
    """Declared outputs: name -> numpy dtype."""
    return {out["name"]: pb_utils.triton_string_to_numpy(out["data_type"]) for out in config.get("output", [])}


def input_arrays(request, names) -> dict[str, np.ndarray | None]:
    """The request's tensors of those names as numpy arrays (None when absent)."""
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        arrays[name] = None if tensor is None else tensor.as_numpy()
    return arrays


def requested_outputs(request) -> set[str] | None:
    """The output names the client asked for; None where it asked for none by name (all are sent)."""
    names = getattr(request, "requested_output_names", lambda: [])()
    return set(names) or None


def output_tensors(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]) -> list:
    """pb_utils tensors of the arrays whose names the model declares, cast to the declared types."""
    return [pb_utils.Tensor(name, np.ascontiguousarray(array).astype(dtypes[name], copy=False))
            for name, array in arrays.items() if name in dtypes]


class ModelGone(TrtglmError):
    """A model this one calls has no running process (not the client's fault: UNAVAILABLE)."""

    status = "UNAVAILABLE"


def cancelled(request) -> bool:
    """Whether the client cancelled `request` (False where this Triton cannot tell)."""
    is_cancelled = getattr(request, "is_cancelled", None)
    return bool(is_cancelled and is_cancelled())


def error_response(error: BaseException):
    """An error response: user errors by their message, anything else as an internal error (logged)."""
    if isinstance(error, TrtglmError):
        message, code = str(error), getattr(error, "status", "INVALID_ARG")
    else:
        log.error("unexpected error", exc_info=error)
        message, code = f"internal error: {type(error).__name__}: {error}", "INTERNAL"
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message, code))


def triton_error(message: str, code: str = "INTERNAL"):
    """pb_utils.TritonError with a status code where this Triton version supports one."""
    status = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message) if status is None else pb_utils.TritonError(message, status)


# --- other models' processes ------------------------------------------------------------------------------


class ModelProcesses:
    """The python-backend stubs running a model's instances in this tritonserver (this stub's siblings).

    Triton 2.51 neither restarts a stub that died nor ends the requests that were in it, so a
    caller that waits on such a request waits forever unless it looks at the process itself.
    A model with no stub ever found (NVIDIA's C++ backend) is never called gone.
    """

    RESCAN_S = 5.0  # while no stub of the model was ever found, look again at most this often

    def __init__(self, model: str):
        self.model = model
        self._instance = re.compile(rf"{re.escape(model)}_\d+_\d+")  # instance names: MODEL_GROUP_INDEX
        self._lock = threading.Lock()
        self._known: list[psutil.Process] = []
        self._seen = False  # a stub was found once: the model runs on the python backend
        self._dead_pid: int | None = None
        self._scanned = float("-inf")

    def running(self) -> list[psutil.Process]:
        """The model's live stubs now; ModelGone when it had stubs and none runs any more."""
        with self._lock:
            if not self._known or gone(self._known):
                self._rescan()
            if self._seen and not self._known:
                raise ModelGone(f"{self.model} is not running: its python-backend process (pid {self._dead_pid}) "
                                "has exited; restart the server")
            return list(self._known)

    def check(self, stubs: list[psutil.Process]) -> None:
        """ModelGone when one of `stubs` (the model's stubs when a request was sent to it) has exited."""
        dead = gone(stubs)
        if dead is not None:
            raise ModelGone(f"{self.model} stopped during this request: its python-backend process (pid {dead.pid}) "
                            "exited; restart the server")

    def _rescan(self) -> None:
        if not self._seen and time.monotonic() - self._scanned < self.RESCAN_S:
            return
        self._scanned = time.monotonic()
        dead = gone(self._known)
        if dead is not None:
            self._dead_pid = dead.pid
        self._known = [proc for proc in _siblings() if self._runs_model(proc) and alive(proc)]
        self._seen = self._seen or bool(self._known)

    def _runs_model(self, proc: psutil.Process) -> bool:
        try:
            args = proc.cmdline()
        except psutil.Error:
            return False
        return bool(args) and os.path.basename(args[0]) == STUB and any(self._instance.fullmatch(a) for a in args)


def _siblings() -> list[psutil.Process]:
    try:
        return psutil.Process(os.getppid()).children()
    except psutil.Error:
        return []


def gone(procs: list[psutil.Process]) -> psutil.Process | None:
    """The first of `procs` that no longer runs, if any."""
    return next((proc for proc in procs if not alive(proc)), None)
