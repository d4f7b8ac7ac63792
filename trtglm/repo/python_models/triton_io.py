"""What trtglm's Triton python models share: the backend's utilities, parameters, tensors, errors.

`triton_python_backend_utils` exists only inside a Triton python-backend process; elsewhere
(tests) `pb_utils` is None and only the plain functions are used.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import numpy as np

from trtglm.errors import TrtglmError, UsageError

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # not inside Triton
    pb_utils = None

log = logging.getLogger(__name__)


def model_config(args: Mapping) -> dict:
    """The model's configuration as `initialize(args)` receives it (JSON text)."""
    return json.loads(args["model_config"])


def parameters(config: Mapping) -> dict[str, str]:
    """`parameters { key: ..., value { string_value: ... } }` as {key: value}."""
    return {key: entry.get("string_value", "") for key, entry in config.get("parameters", {}).items()}


def parameter(params: Mapping[str, str], key: str, model: str) -> str:
    if key not in params or params[key] == "" or params[key].startswith("${"):
        raise UsageError(f"{model}: parameter {key} is not set (render the repository with trtglm patch-repo)")
    return params[key]


def int_parameter(params: Mapping[str, str], key: str, model: str) -> int:
    value = parameter(params, key, model)
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{model}: parameter {key} must be an integer, not {value!r}") from None


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


def output_tensors(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]) -> list:
    """pb_utils tensors of the arrays whose names the model declares, cast to the declared types."""
    return [pb_utils.Tensor(name, np.ascontiguousarray(array).astype(dtypes[name], copy=False))
            for name, array in arrays.items() if name in dtypes]


def strings(texts) -> np.ndarray:
    """A BYTES tensor's array from text."""
    return np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=np.object_)


def error_response(error: BaseException):
    """An error response: user errors by their message, anything else as an internal error (logged)."""
    if isinstance(error, TrtglmError):
        message, code = str(error), "INVALID_ARG"
    else:
        log.error("unexpected error", exc_info=error)
        message, code = f"internal error: {type(error).__name__}: {error}", "INTERNAL"
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(message, code))


def triton_error(message: str, code: str = "INTERNAL"):
    """pb_utils.TritonError with a status code where this Triton version supports one."""
    status = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message) if status is None else pb_utils.TritonError(message, status)
