"""The history API of the first ChatGLM3-on-Triton deployments (model chatglm3-6b) on a launched server of
the fixture's engine, rendered from trtglm's template and patched from NVIDIA's v0.19.0: a client of
those deployments holds a multi-turn conversation over HTTP /v2/models/chatglm3-6b/infer (the JSON it
posts) and gRPC (tritonclient), passing back the history each reply gives; the answers are the
fixture's exact ones, history_len keeps the last rounds, and bad requests get error responses while the
server keeps serving."""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest

from conftest import SHARED
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.servers import Server

pytestmark = pytest.mark.slow

MODEL = "chatglm3-6b"
TEMPLATES = {"trtglm": None, "nvidia-v0.19.0": SHARED / "upstream/tensorrtllm_backend-v0.19.0/inflight_batcher_llm"}
SKY = [{"role": "user", "content": "What color is the sky?"},
       {"role": "assistant", "metadata": "", "content": "The sky is blue."}]
GRASS = [{"role": "user", "content": "What color is grass?"},
         {"role": "assistant", "metadata": "", "content": "Grass is green."}]
BEES = [{"role": "user", "content": "What do bees make?"},
        {"role": "assistant", "metadata": "", "content": "Bees make honey."}]


@pytest.fixture(scope="module", params=TEMPLATES, ids=list(TEMPLATES))
def server(request, tmp_path_factory):
    if TEMPLATES[request.param] is not None and not TEMPLATES[request.param].is_dir():
        pytest.skip(f"NVIDIA's layout is not here: {TEMPLATES[request.param]}")
    root = tmp_path_factory.mktemp("history-api")
    engine = build_tiny_engine(root / "engine", tp=1)
    server = Server(patch_repo(engine, None, root / "repo", template=TEMPLATES[request.param]), 1, root / "state")
    yield server
    server.stop()


def http_infer(server, prompt: str, history: str, max_token: int = 512, history_len: int = 10,
               temperature: str = "0") -> tuple[int, dict]:
    """What those deployments' HTTP clients post: every input one element, max_batch_size 0."""
    inputs = [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": [prompt]},
              {"name": "history", "datatype": "BYTES", "shape": [1], "data": [history]},
              {"name": "temperature", "datatype": "BYTES", "shape": [1], "data": [temperature]},
              {"name": "max_token", "datatype": "INT16", "shape": [1], "data": [max_token]},
              {"name": "history_len", "datatype": "INT16", "shape": [1], "data": [history_len]}]
    status, text = server.post(f"/v2/models/{MODEL}/infer", json.dumps({"inputs": inputs}).encode())
    body = json.loads(text)
    if status != 200:
        return status, body
    return status, {out["name"]: out["data"][0] for out in body["outputs"]}


def grpc_infer(server, prompt: str, history: str, max_token: int = 512, history_len: int = 10) -> dict:
    import tritonclient.grpc as grpc

    arrays = {"prompt": np.array([prompt.encode()], dtype=object),
              "history": np.array([history.encode()], dtype=object),
              "temperature": np.array([b"0"], dtype=object),
              "max_token": np.array([max_token], dtype=np.int16),
              "history_len": np.array([history_len], dtype=np.int16)}
    client = grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        tensors = []
        for name, array in arrays.items():
            tensor = grpc.InferInput(name, list(array.shape), "INT16" if array.dtype == np.int16 else "BYTES")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(MODEL, tensors)
        return {name: result.as_numpy(name)[0].decode() for name in ("response", "history")}
    finally:
        client.close()


def test_a_conversation_over_http_and_grpc_gets_the_fixtures_answers(server):
    status, first = http_infer(server, "What color is the sky?", "")
    assert status == 200, first
    assert first["response"] == "The sky is blue."
    assert first["history"] == repr(SKY)  # the Python literal ChatGLM3's chat() history prints as
    second = grpc_infer(server, "And grass?", first["history"])
    assert second["response"] == "Grass is green."
    assert ast.literal_eval(second["history"]) == [*SKY, {"role": "user", "content": "And grass?"},
                                                  {"role": "assistant", "metadata": "", "content": "Grass is green."}]


def test_history_len_keeps_the_last_rounds(server):
    three_rounds = repr([*SKY, *GRASS, *BEES])
    status, whole = http_infer(server, "What is two plus three?", three_rounds, history_len=3)
    assert (status, whole["response"]) == (200, "Two plus three is five.")
    status, last = http_infer(server, "Say it again.", three_rounds, history_len=1)
    assert (status, last["response"]) == (200, "Bees make honey.")  # only the bees round was seen
    assert ast.literal_eval(last["history"]) == [*BEES, {"role": "user", "content": "Say it again."},
                                                {"role": "assistant", "metadata": "", "content": "Bees make honey."}]


@pytest.mark.parametrize("change, message", [
    ({"history": "__import__('os').system('id')"}, "history is neither a Python literal nor JSON"),
    ({"history": "[{'role': 'robot', 'content': 'hi'}]"}, "message 0: role must be one of"),
    ({"temperature": "warm"}, "temperature must be a number written as text"),
    ({"max_token": 5}, "max_token 5 leaves no room for a reply"),
    ({"history_len": -1}, "history_len must be between 0 and 32767, not -1"),
    ({"prompt": ""}, "prompt is empty"),
])
def test_bad_requests_get_error_responses_and_the_server_keeps_serving(server, change, message):
    request = {"prompt": "What do bees make?", "history": "", **change}
    status, body = http_infer(server, **request)
    assert status == 400 and message in body["error"], body
    status, good = http_infer(server, "What do bees make?", "")
    assert (status, good["response"]) == (200, "Bees make honey.")
