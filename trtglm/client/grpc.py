"""Generate over gRPC with tritonclient's bidirectional stream (`start_stream` / `async_stream_infer`).

The stream serves whole and streamed replies alike, decoupled models included (plain `infer`
refuses those). The request asks for an empty final response, so the last response of a
request is known by its `triton_final_response` parameter. Inputs get the datatypes of the
ensemble's config (trtllm.md §3) and a batch dimension when the model batches.
"""

from __future__ import annotations

import logging
import queue
from typing import Iterator

import numpy as np

from trtglm.client import ANSWER_TIMEOUT_S, GenerateRequest, ServerError, check_model, one_line
from trtglm.errors import DependencyError, UsageError

log = logging.getLogger(__name__)

INPUT_TYPES = {  # model input -> (numpy dtype, Triton datatype)
    "text_input": (np.object_, "BYTES"),
    "max_tokens": (np.int32, "INT32"),
    "stream": (np.bool_, "BOOL"),
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "beam_width": (np.int32, "INT32"),
    "random_seed": (np.uint64, "UINT64"),
}


def check_address(address: str) -> str:
    """HOST:PORT of a Triton gRPC endpoint (a leading grpc:// is dropped)."""
    if not isinstance(address, str):
        raise UsageError(f"--grpc must be HOST:PORT, not {address!r}")
    address = address.removeprefix("grpc://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--grpc {address}: expected HOST:PORT")
    return address


def generate_stream(address: str, model: str, request: GenerateRequest,
                    timeout: float = ANSWER_TIMEOUT_S) -> Iterator[str]:
    """The reply's text pieces as the server sends them (one piece when not streamed)."""
    grpcclient, InferenceServerException = _tritonclient()
    address, model = check_address(address), check_model(model)
    client = grpcclient.InferenceServerClient(address)
    responses: queue.Queue = queue.Queue()
    finished = False
    try:
        batched = _batched(client, address, model, InferenceServerException)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, _inputs(grpcclient, request, batched),
                                  outputs=[grpcclient.InferRequestedOutput("text_output")],
                                  enable_empty_final_response=True)
        while not finished:
            result, error = _next(responses, timeout, address)
            if error is not None:
                raise ServerError(f"{model}: {one_line(error.message())}")
            finished = _is_final(result)
            piece = _text(result)
            if piece:
                yield piece
    except InferenceServerException as e:
        raise ServerError(f"{model}: {one_line(e.message())}") from None
    finally:
        try:
            client.stop_stream(cancel_requests=not finished)
        finally:
            client.close()


def _tritonclient():
    try:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
    except ImportError:
        raise DependencyError("tritonclient is not installed: pip install 'tritonclient[grpc]'") from None
    return grpcclient, InferenceServerException


def _batched(client, address: str, model: str, server_exception) -> bool:
    """Whether the model batches (its inputs then take a leading batch dimension)."""
    try:
        config = client.get_model_config(model, as_json=True)
    except server_exception as e:
        status = str(e.status() or "")
        if "UNAVAILABLE" in status or "failed to connect" in (e.message() or ""):
            raise ServerError(f"cannot reach Triton at {address}: {one_line(e.message())}") from None
        raise ServerError(f"{model}: {one_line(e.message())}") from None
    return int(config.get("config", {}).get("max_batch_size", 0)) > 0


def _inputs(grpcclient, request: GenerateRequest, batched: bool) -> list:
    inputs = []
    for name, value in request.inputs().items():
        dtype, datatype = INPUT_TYPES[name]
        array = np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=dtype)
        if batched:
            array = array.reshape(1, 1)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _next(responses: queue.Queue, timeout: float, address: str):
    try:
        return responses.get(timeout=timeout)
    except queue.Empty:
        raise ServerError(f"no answer from Triton at {address} within {timeout:g} s") from None


def _is_final(result) -> bool:
    parameters = result.get_response().parameters
    return "triton_final_response" in parameters and parameters["triton_final_response"].bool_param


def _text(result) -> str:
    array = result.as_numpy("text_output")
    if array is None:
        return ""
    return "\n".join(item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in array.reshape(-1))
