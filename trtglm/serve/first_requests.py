"""The first request each client-facing model of a launch answers before the launch reports ready (supervise.py):
`ensemble` and `tensorrt_llm_bls` a short prompt through /generate, the history model `chatglm3-6b` one /infer
with the inputs its config declares."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from trtglm.backend.contract import HISTORY_CHAT
from trtglm.model_repository import has_model, model_config, protobuf

CHECKED_MODELS = ("ensemble", "tensorrt_llm_bls")  # asked once before the launch reports ready
CHECK_PROMPT, CHECK_TOKENS, CHECK_TIMEOUT_S = "你好", 4, 120.0
# the history model's first request: max_token counts the prompt (a few tokens here) and the reply together
CHECK_HISTORY = {"prompt": CHECK_PROMPT, "history": "", "temperature": "0", "max_token": 16, "history_len": 0}


def first_requests(repo: Path) -> list[tuple[str, Callable[[str], object]]]:
    """(model, ask it its first request at a Triton HTTP URL) for each model clients ask that `repo` has."""
    asks: list[tuple[str, Callable[[str], object]]] = [
        (model, partial(ask_generate, model)) for model in CHECKED_MODELS if has_model(repo, model)]
    if has_model(repo, HISTORY_CHAT):
        asks.append((HISTORY_CHAT, partial(ask_history_model, repo)))
    return asks


def ask_generate(model: str, url: str) -> str:
    """`ensemble` or `tensorrt_llm_bls`: a short prompt through /generate, a few tokens."""
    from trtglm.client import GenerateRequest
    from trtglm.client.http import generate

    return generate(url, model, GenerateRequest(CHECK_PROMPT, CHECK_TOKENS), timeout=CHECK_TIMEOUT_S)


def ask_history_model(repo: Path, url: str) -> dict:
    """The history model: one /infer with the inputs its config declares (CHECK_HISTORY's values: a short
    prompt, no history, greedy); every output it declares must come back."""
    from trtglm.client import ServerError
    from trtglm.client.http import infer

    config = model_config(repo, HISTORY_CHAT)
    shape = [1, 1] if config.max_batch_size > 0 else [1]
    inputs = [{"name": tensor.name, "datatype": _http_datatype(tensor.data_type), "shape": shape,
               "data": [CHECK_HISTORY[tensor.name]]} for tensor in config.input if tensor.name in CHECK_HISTORY]
    outputs = infer(url, config.name or HISTORY_CHAT, inputs, timeout=CHECK_TIMEOUT_S)
    missing = [tensor.name for tensor in config.output if tensor.name not in outputs]
    if missing:
        raise ServerError(f"the answer lacks the output(s) {', '.join(missing)}")
    return outputs


def _http_datatype(data_type: int) -> str:
    """Triton's HTTP datatype of a config's TYPE_* (TYPE_STRING is BYTES)."""
    name = protobuf()[1].DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name
