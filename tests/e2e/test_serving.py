"""trtglm's PyTorch runtime served as Triton's `tensorrt_llm` model, end to end: the fixture engine
(configs/tiny.yaml) rendered by patch-repo and started by `trtglm launch --detach` with 1, 2 and 4
ranks (real tritonserver processes under a real mpirun, free loopback ports), answering the fixture's
conversations exactly through `ensemble` and `tensorrt_llm_bls` over HTTP generate, SSE
generate_stream and gRPC streaming; 32 concurrent requests batched in flight; bad requests refused
with a message while the server goes on; a cancelled request stops generating. The first part
checks the model's request and response tensors against TensorRT-LLM's documented layout."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import pytest

from conftest import CONVERSATION_KINDS, repo_processes
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.servers import Server
from support.tokenizer import reply_ids
from trtglm.chatglm.chat import chat_ids, prompt_ids, reply_text, stack_word_lists, stop_ids, word_list
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import UsageError
from trtglm.backend.llm_requests import batch_size, engine_request, engine_requests
from trtglm.backend.llm_responses import Responder
from trtglm.runtime.request import Output

WORLD_SIZES = (1, 2, 4)
RETURN_SEQUENCES = 8  # the most sequences of one prompt engine_requests is told to allow
KINDS = {kind: match for kind, match in CONVERSATION_KINDS.items()  # also streamed: the first of each kind
         if kind != "tool call and observation"}


# --- the tensor contract (no server) --------------------------------------------------------------------


def arrays(**values) -> dict[str, np.ndarray]:
    """A request's input arrays as Triton gives them (batch first)."""
    base = {"input_ids": np.array([[5, 6, 7, 0]], np.int32), "input_lengths": np.array([3], np.int32),
            "request_output_len": np.array([4], np.int32)}
    return {**base, **values}


def test_request_tensors_become_an_executor_request():
    stop_words = stack_word_lists([word_list([[518], [520], [30, 31]])])
    request, streaming = engine_request(arrays(
        end_id=np.array([2], np.int32), stop_words_list=stop_words,
        bad_words_list=stack_word_lists([word_list([[9]])]), embedding_bias=np.zeros((1, 0), np.float32),
        streaming=np.array([[True]]), return_log_probs=np.array([True]), min_length=np.array([2], np.int32)))
    assert list(request.prompt) == [5, 6, 7] and request.max_tokens == 4 and request.end_id == 2
    assert request.stop_words == [[518], [520], [30, 31]] and request.bad_words == [[9]]
    assert request.embedding_bias is None and request.sampling.min_tokens == 2 and streaming
    assert request.output.return_log_probs and not request.output.return_context_logits
    assert request.sampling.temperature == 0  # neither runtime_top_k nor runtime_top_p: greedy, as TensorRT-LLM


@pytest.mark.parametrize("sampling, expected", [
    ({"runtime_top_k": np.array([40], np.int32)}, (1.0, 40, 1.0)),
    ({"runtime_top_p": np.array([0.9], np.float32), "temperature": np.array([0.7], np.float32)}, (0.7, 0, 0.9)),
    ({"temperature": np.array([0.7], np.float32)}, (0.0, 0, 1.0)),  # temperature alone: still greedy
])
def test_sampling_follows_tensorrt_llms_rules(sampling, expected):
    chosen = engine_request(arrays(**sampling, random_seed=np.array([2**63 + 5], np.uint64)))[0].sampling
    assert (chosen.temperature, chosen.top_k) == pytest.approx(expected[:2])
    assert chosen.top_p == pytest.approx(expected[2]) and chosen.seed == 2**63 + 5


def test_penalties_reach_the_executor_request():
    penalised = engine_request(arrays(repetition_penalty=np.array([1.2], np.float32),
                                      presence_penalty=np.array([0.5], np.float32),
                                      frequency_penalty=np.array([0.25], np.float32)))[0].sampling
    assert (penalised.repetition_penalty, penalised.presence_penalty, penalised.frequency_penalty) == \
        pytest.approx((1.2, 0.5, 0.25))
    plain = engine_request(arrays())[0].sampling
    assert (plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("extra, message", [
    ({"input_ids": np.zeros((2, 3), np.int32)}, "input_lengths has 1 rows for the 2 sequences of input_ids"),
    ({"request_output_len": np.array([-2**31], np.int32)}, r"request_output_len must be between 1 and 2147483647, "
                                                           r"not -2147483648 \(over HTTP JSON .* 2147483648 arrives"),
    ({"runtime_top_k": np.array([-1], np.int32)}, "runtime_top_k must be between 0 and 2147483647, not -1"),
    ({"beam_width": np.array([0], np.int32)}, "beam_width must be between 1 and 2147483647, not 0"),
    ({"beam_width": np.array([2], np.int32), "streaming": np.array([True])}, "streaming takes beam_width 1, not 2"),
    ({"input_lengths": np.array([9], np.int32)}, "input_lengths 9 must be between 1 and the 4 ids"),
    ({"stop_words_list": np.array([[[1, 2], [3, -1]]], np.int32)}, r"offset 3 does not follow 0 within 2 ids"),
])
def test_requests_outside_the_contract_are_usage_errors(extra, message):
    with pytest.raises(UsageError, match=message):
        engine_requests({**arrays(), **extra}, RETURN_SEQUENCES)
    with pytest.raises(UsageError, match="request_output_len is required"):
        engine_requests({k: v for k, v in arrays().items() if k != "request_output_len"}, RETURN_SEQUENCES)


def two_sequences(**values) -> dict[str, np.ndarray]:
    """A request of two sequences, as Triton gives it (every input batch first)."""
    base = {"input_ids": np.array([[5, 6, 7, 0], [8, 9, 10, 11]], np.int32), "input_lengths": np.array([3, 4], np.int32),
            "request_output_len": np.array([4, 6], np.int32), "streaming": np.array([[False], [False]])}
    return {**base, **values}


def test_each_sequence_of_a_batch_is_a_request_of_its_own():
    (first, second), streaming = engine_requests(two_sequences(end_id=np.array([2, 3], np.int32)), RETURN_SEQUENCES)
    assert (list(first.prompt), first.max_tokens, first.end_id) == ([5, 6, 7], 4, 2)
    assert (list(second.prompt), second.max_tokens, second.end_id) == ([8, 9, 10, 11], 6, 3)
    assert streaming is False


@pytest.mark.parametrize("extra, message", [
    ({"request_output_len": np.array([4, 0], np.int32)}, "sequence 1 of 2: request_output_len must be between 1"),
    ({"streaming": np.array([[True], [False]])}, "streaming must be the same for every sequence"),
])
def test_a_batch_with_a_bad_sequence_is_refused_whole(extra, message):
    with pytest.raises(UsageError, match=message):
        engine_requests(two_sequences(**extra), RETURN_SEQUENCES)


def test_a_streamed_batch_is_a_streamed_request_per_prompt():
    """NVIDIA's decoupled backend streams each prompt of a batch; the model refuses a batch when not decoupled."""
    requests, streaming = engine_requests(two_sequences(streaming=np.array([[True], [True]])), RETURN_SEQUENCES)
    assert [list(r.prompt) for r in requests] == [[5, 6, 7], [8, 9, 10, 11]] and streaming is True
    assert batch_size(two_sequences()) == 2 and batch_size(arrays()) == 1


def test_streamed_responses_carry_new_ids_and_the_last_is_final():
    sent, failed = [], []
    reply = Responder(True, lambda arrays, final: sent.append((arrays, final)), failed.append)
    reply(Output([11], [-0.5]))
    reply(Output([12], [-0.25]))
    reply(Output([], finished=True, reason="end_id"))  # end_id: nothing more to return
    assert [a["output_ids"].tolist() for a, _ in sent] == [[[[11]]], [[[12]]], [[[]]]]
    assert [a["sequence_length"].tolist() for a, _ in sent] == [[[1]], [[1]], [[0]]]
    assert [a["generated_ids"].tolist() for a, _ in sent] == [[[[11]]], [[[11, 12]]], [[[11, 12]]]]
    assert [(a["is_final"].tolist(), final) for a, final in sent] == [([[False]], False), ([[False]], False),
                                                                       ([[True]], True)]
    assert [a["cum_log_probs"].tolist() for a, _ in sent] == [[[-0.5]], [[-0.75]], [[-0.75]]]
    assert sent[1][0]["output_log_probs"].tolist() == [[[-0.25]]] and not failed


def test_a_whole_reply_is_one_response_and_errors_fail_it():
    sent, failed = [], []
    reply = Responder(False, lambda arrays, final: sent.append((arrays, final)), failed.append)
    for output in (Output([11]), Output([12]), Output([518], finished=True, reason="stop_word")):
        reply(output)
    assert len(sent) == 1 and sent[0][1] is True
    assert sent[0][0]["output_ids"].tolist() == [[[11, 12, 518]]] and sent[0][0]["sequence_length"].tolist() == [[3]]
    assert sent[0][0]["output_log_probs"].tolist() == [[[0.0, 0.0, 0.0]]]  # zeros unless asked for
    cancelled = Responder(True, lambda *_: None, failed.append)
    cancelled(Output([], finished=True, reason="cancelled"))
    assert failed == ["the request was cancelled"]


# --- real servers -------------------------------------------------------------------------------------------


def text_inputs(text: str, max_tokens: int = 64, **extra: np.ndarray) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[text.encode()]], dtype=np.object_),
            "max_tokens": np.array([[max_tokens]], dtype=np.int32), **extra}


def chat(conversation: dict) -> str:
    return json.dumps({"messages": conversation["messages"]}, ensure_ascii=False)


@pytest.fixture(scope="module")
def conversations(fixture_dir) -> list[dict]:
    return [json.loads(line) for line in (fixture_dir / "conversations.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def streamed(conversations) -> list[dict]:
    return [next(c for c in conversations if matches(c)) for matches in KINDS.values()]


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"world{w}" for w in WORLD_SIZES])
def server(request, tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    world = request.param
    if world > 1 and subprocess.run(["sh", "-c", "command -v mpirun"], capture_output=True).returncode != 0:
        pytest.skip("mpirun (openmpi-bin) is not installed")
    root = tmp_path_factory.mktemp(f"world{world}")
    repo = patch_repo(build_tiny_engine(root / "engine", tp=world), None, root / "repo")
    server = Server(repo, world, root / "state")
    yield server
    server.stop()


def ask_all(server: Server, model: str, conversations: list[dict], workers: int = 8) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda c: server.generate(model, {"text_input": chat(c), "max_tokens": 64}),
                             conversations))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_every_conversation_is_answered_exactly_and_stops_at_its_stop_token(server, conversations, tok, model):
    for conversation, (status, body) in zip(conversations, ask_all(server, model, conversations), strict=True):
        assert status == 200, body
        assert body["text_output"] == conversation["answer"]
        # one log probability per generated token: the metadata line, the answer, then the stop token (and nothing
        # after it): <|user|>, or <|observation|> after a tool call
        assert len(body["output_log_probs"]) == len(reply_ids(tok.sp, conversation))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_sse_pieces_join_to_the_answer(server, streamed, model):
    for conversation in streamed:
        status, events = server.stream(model, {"text_input": chat(conversation), "max_tokens": 64})
        assert status == 200 and not any("error" in e for e in events), events
        pieces = [e["text_output"] for e in events]
        assert "".join(pieces) == conversation["answer"]
        assert sum(1 for p in pieces if p) > 1 and not any("\ufffd" in p for p in pieces)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_stream_pieces_join_to_the_answer(server, streamed, model):
    for conversation in streamed:
        responses = server.grpc_stream(model, text_inputs(chat(conversation), stream=np.array([[True]])))
        pieces = [r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses
                  if r.as_numpy("text_output") is not None]
        assert "".join(pieces) == conversation["answer"] and len(pieces) > 1


@pytest.mark.slow
def test_32_concurrent_requests_are_answered_exactly_and_batched(server, conversations):
    chosen = (conversations * 2)[:32]
    for conversation, (status, body) in zip(chosen, ask_all(server, "ensemble", chosen, workers=32), strict=True):
        assert status == 200 and body["text_output"] == conversation["answer"], body
    deadline = time.monotonic() + 5
    # The gauges are published twice a second: one snapshot can show the last request queued, none active.
    while ((metrics := server.metrics())["trtglm_active_sequences"] or metrics["trtglm_queued_requests"]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics["trtglm_max_decode_batch"] == 8  # the engine's max_batch_size, every slot in use
    assert metrics["trtglm_generated_tokens_total"] > 2 * metrics["trtglm_decode_steps_total"]  # > 1 per step
    assert metrics["trtglm_active_sequences"] == 0 and metrics["trtglm_queued_requests"] == 0
    assert 0 < metrics["trtglm_decode_only_steps_total"] < metrics["trtglm_decode_steps_total"]  # prompts came too
    assert 0 < metrics["trtglm_decode_only_step_microseconds_total"] < metrics["trtglm_step_microseconds_total"]


@pytest.mark.slow
def test_bad_requests_get_4xx_with_a_message_and_the_server_goes_on(server, conversations):
    if server.world != 1:
        pytest.skip("refusals happen before tensorrt_llm; one world size shows them")
    for model in ("ensemble", "tensorrt_llm_bls"):
        cases = {
            json.dumps({"max_tokens": 8}): "text_input",
            json.dumps({"text_input": "hi", "max_tokens": -1}): "max_tokens must be between 1 and 2147483647, not -1",
            json.dumps({"text_input": "hi " * 400, "max_tokens": 8}): "more than the engine's max_input_len (256)",
            json.dumps({"text_input": '[{"role": "robot", "content": "x"}]', "max_tokens": 8}): "role must be one of",
        }
        for body, message in cases.items():
            status, text = server.post(f"/v2/models/{model}/generate", body.encode())
            assert 400 <= status < 500 and message in json.loads(text)["error"], (body, status, text)
        # JSON that does not parse never reaches a model: Triton's HTTP frontend refuses it itself (with
        # status 500 in Triton 2.51, which maps its JSON parser's errors so)
        status, text = server.post(f"/v2/models/{model}/generate", b'{"text_input": "hi", "max_tokens": ')
        assert status >= 400 and "failed to parse the request JSON buffer" in json.loads(text)["error"]
        status, body = server.generate(model, {"text_input": chat(conversations[0]), "max_tokens": 64})
        assert status == 200 and body["text_output"] == conversations[0]["answer"]


def three_different(conversations: list[dict]) -> list[dict]:
    """Three one-message conversations with different answers of different lengths."""
    chosen = []
    for conversation in conversations:
        if len(conversation["messages"]) == 1 and all(len(c["answer"]) != len(conversation["answer"])
                                                      for c in chosen):
            chosen.append(conversation)
    return chosen[:3]


def by_batch_index(responses: list, output: str) -> dict[int, list]:
    """Each response's `output` under its batch_index ([1, 1], on every response but a flags-only final one)."""
    items: dict[int, list] = {}
    for response in responses:
        if response.as_numpy(output) is None:
            continue
        index = response.as_numpy("batch_index")
        assert index is not None and index.shape == (1, 1), index
        items.setdefault(int(index[0, 0]), []).append(response.as_numpy(output))
    return items


def finals(responses: list) -> list[bool]:
    return [r.get_response().parameters["triton_final_response"].bool_param for r in responses]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_in_one_request_is_answered_per_prompt_with_its_batch_index(server, conversations, model, stream):
    """As NVIDIA's decoupled backend: each prompt of the batch in responses of its own ([1] text_output with a
    [1, 1] batch_index), the prompts' responses interleaved as they are generated, the final flag after all."""
    if server.world != 1:
        pytest.skip("the sequences of a request are rank 0's executor's, the same for every world size")
    chosen = three_different(conversations)
    inputs = {"text_input": np.array([[chat(c).encode()] for c in chosen], dtype=np.object_),
              "max_tokens": np.array([[64]] * 3, np.int32), "stream": np.array([[stream]] * 3)}
    responses = server.grpc_stream(model, inputs)
    items = by_batch_index(responses, "text_output")
    assert all(text.shape == (1,) for texts in items.values() for text in texts)
    assert {i: "".join(t[0].decode() for t in texts) for i, texts in items.items()} == \
        {i: c["answer"] for i, c in enumerate(chosen)}
    assert finals(responses)[-1] and not any(finals(responses)[:-1])
    order = [int(r.as_numpy("batch_index")[0, 0]) for r in responses if r.as_numpy("batch_index") is not None]
    if stream:
        assert order != sorted(order), order  # generated together, not one prompt after the other
    else:
        assert sorted(order) == [0, 1, 2], order  # one whole reply each


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_a_batch_to_tensorrt_llm_answers_each_prompts_ids_with_its_batch_index(server, conversations, tok, streaming):
    """tensorrt_llm itself (NVIDIA's contract): output_ids [1, 1, n] and sequence_length [1, 1] per response, each
    prompt's ids joining to exactly the fixture's reply ids for it (stop token included, as TensorRT-LLM returns
    it), batch_index [1, 1] on every response; the final flag on the last response only."""
    if server.world != 1:
        pytest.skip("the sequences of a request are rank 0's executor's, the same for every world size")
    chosen = three_different(conversations)
    prompts = [chat_ids(tok, c["messages"]) for c in chosen]
    width = max(map(len, prompts))
    stops = word_list([[tok.special_ids["<|user|>"]], [tok.special_ids["<|observation|>"]]])
    inputs = {"input_ids": np.array([p + [0] * (width - len(p)) for p in prompts], np.int32),
              "input_lengths": np.array([[len(p)] for p in prompts], np.int32),
              "request_output_len": np.array([[64]] * 3, np.int32),
              "end_id": np.array([[tok.eos_id]] * 3, np.int32), "stop_words_list": stack_word_lists([stops] * 3),
              "streaming": np.array([[streaming]] * 3)}
    responses = server.grpc_stream("tensorrt_llm", inputs)
    assert all(r.as_numpy("output_ids").shape[:2] == (1, 1) and r.as_numpy("sequence_length").shape == (1, 1)
               for r in responses)
    items = by_batch_index(responses, "output_ids")
    assert {i: [t for ids in parts for t in ids.reshape(-1).tolist()] for i, parts in items.items()} == \
        {i: reply_ids(tok.sp, c) for i, c in enumerate(chosen)}
    assert finals(responses)[-1] and not any(finals(responses)[:-1])
    if not streaming:
        assert sorted(len(parts) for parts in items.values()) == [1, 1, 1]


@pytest.mark.slow
def test_a_batch_over_http_comes_per_prompt_from_generate_stream_and_not_at_all_from_generate(server, conversations):
    """generate_stream: one event per response, each with its batch_index. Triton's /generate wants exactly one
    response, and a batch gets one per prompt (as from NVIDIA's backend): Triton refuses it, and the server goes
    on."""
    if server.world != 1:
        pytest.skip("Triton's HTTP frontend, the same for every world size")
    chosen = three_different(conversations)[:2]
    body = {"text_input": [chat(c) for c in chosen], "max_tokens": [64, 64], "stream": [True, True]}
    status, text = server.post("/v2/models/ensemble/generate_stream", json.dumps(body).encode())
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    assert status == 200 and events and all("batch_index" in e for e in events), (status, text)
    assert ["".join(e["text_output"] for e in events if e["batch_index"] == i) for i in (0, 1)] == \
        [c["answer"] for c in chosen]
    status, body = server.generate("ensemble", {"text_input": [chat(c) for c in chosen], "max_tokens": [64, 64]})
    assert "generate expects model to produce exactly 1 response" in body.get("error", ""), (status, body)
    status, body = server.generate("ensemble", {"text_input": chat(chosen[0]), "max_tokens": 64})
    assert status == 200 and body["text_output"] == chosen[0]["answer"]


@pytest.mark.slow
def test_a_cancelled_request_stops_generating(server, tok):
    if server.world != 1:
        pytest.skip("cancellation is the executor's, the same for every world size")
    before = settled_metrics(server)["trtglm_generated_tokens_total"]
    prompt = np.array([prompt_ids(tok, "hi")], np.int32)
    inputs = {"input_ids": prompt, "input_lengths": np.array([[prompt.shape[1]]], np.int32),
              "request_output_len": np.array([[400]], np.int32), "streaming": np.array([[True]]),
              "bad_words_list": stack_word_lists([word_list([[tok.special_ids["<|user|>"]], [tok.eos_id]])])}
    assert len(server.grpc_stream("tensorrt_llm", inputs, read=3)) == 3  # then the client cancels
    after = settled_metrics(server)
    assert after["trtglm_active_sequences"] == 0
    assert after["trtglm_generated_tokens_total"] - before < 200  # far from the 400 asked for


def settled_metrics(server, timeout: float = 10) -> dict[str, float]:
    """The server's metrics once nothing is running and the counters have caught up (they refresh every 0.5 s,
    so a reading right after a request may miss its last tokens)."""
    deadline = time.monotonic() + timeout
    time.sleep(1.1)
    while server.metrics()["trtglm_active_sequences"] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.1)
    return server.metrics()


@pytest.mark.slow
def test_seeds_and_log_probs_through_the_ensemble(server, conversations):
    if server.world != 1:
        pytest.skip("sampling is rank 0's, the same for every world size")
    question = {"text_input": chat(conversations[0]), "max_tokens": 24, "top_k": 100, "temperature": 4.0}
    texts = {seed: server.generate("ensemble", {**question, "random_seed": seed})[1]["text_output"]
             for seed in (7, 8, 9)}
    assert server.generate("ensemble", {**question, "random_seed": 7})[1]["text_output"] == texts[7]
    status, events = server.stream("ensemble", {**question, "random_seed": 7})
    assert status == 200 and "".join(e["text_output"] for e in events) == texts[7]
    assert len(set(texts.values())) > 1 and conversations[0]["answer"] not in texts.values()  # really sampled
    status, body = server.generate("ensemble", {"text_input": chat(conversations[0]), "max_tokens": 64,
                                                "return_log_probs": True})
    assert status == 200 and body["text_output"] == conversations[0]["answer"]
    assert all(-1.0 < p <= 0.0 for p in body["output_log_probs"]) and min(body["output_log_probs"]) < 0.0
    assert body["cum_log_probs"] == pytest.approx(sum(body["output_log_probs"]), abs=1e-5)

@pytest.mark.slow
def test_unloading_and_loading_tensorrt_llm_again(server, conversations):
    """finalize stops the executor and frees the model; a new load serves again (one rank: with several, the
    followers end with rank 0's model and a reload needs a new launch)."""
    if server.world != 1:
        pytest.skip("ranks > 0 follow the rank 0 model they started with")
    url = f"http://127.0.0.1:{server.http_port}"
    assert server.cli("models", "unload", "tensorrt_llm", "--url", url).returncode == 0
    deadline = time.monotonic() + 20
    while server.status("/v2/models/tensorrt_llm/ready") == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.status("/v2/models/tensorrt_llm/ready") == 400
    time.sleep(3)  # past stubs.UNLOADING_S: the supervisor must not take this unload for a crash
    assert server.status("/v2/models/tensorrt_llm/ready") == 400
    status, body = server.generate("ensemble", {"text_input": chat(conversations[0]), "max_tokens": 64})
    assert status >= 400 and "error" in body  # the ensemble is unavailable without its member
    assert server.cli("models", "load", "tensorrt_llm", "--url", url, timeout=120).returncode == 0
    assert server.status("/v2/models/tensorrt_llm/ready") == 200
    status, body = server.generate("ensemble", {"text_input": chat(conversations[0]), "max_tokens": 64})
    assert status == 200 and body["text_output"] == conversations[0]["answer"]

@pytest.mark.slow
def test_enable_kv_cache_reuse_serves_a_shared_system_prompt_once_with_the_same_answers(server, conversations,
                                                                                      tmp_path):
    """A repository rendered with --set enable_kv_cache_reuse=true: requests behind one long system prompt get the
    answers the server without reuse gives, and the engine counts the prompt tokens it took from its cache."""
    if server.world != 1:
        pytest.skip("one world size shows the parameter's path")
    system = {"role": "system", "content": " ".join(c["answer"] for c in conversations[:8])}
    requests = [{"messages": [system, *c["messages"]]} for c in conversations[:4]]
    bodies = [{"text_input": json.dumps(r, ensure_ascii=False), "max_tokens": 24} for r in requests]
    expected = [server.generate("ensemble", body) for body in bodies]
    repo = patch_repo(build_tiny_engine(tmp_path / "engine"), None, tmp_path / "repo",
                      sets={"enable_kv_cache_reuse": True})
    reusing = Server(repo, 1, tmp_path / "state")
    try:
        assert [reusing.generate("ensemble", body) for body in bodies] == expected
        assert all(status == 200 for status, _ in expected)
        metrics = settled_metrics(reusing)
        assert metrics["trtglm_reused_prompt_tokens_total"] >= 64 * (len(bodies) - 1)  # a block at least each
        assert settled_metrics(server)["trtglm_reused_prompt_tokens_total"] == 0  # off unless set
    finally:
        reusing.stop()


@pytest.mark.slow
def test_a_full_queue_answers_busy_at_once_and_serving_goes_on(tmp_path, conversations):
    """tensorrt_llm's max_queue_size bounds the requests waiting (Triton's scheduler queue and the executor's
    queue for a slot): a burst beyond it is refused at once with a message, and serving goes on."""
    pytest.importorskip("pytriton")
    repo = patch_repo(build_tiny_engine(tmp_path / "engine"), None, tmp_path / "repo")
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_queue_size: 0", "max_queue_size: 2"))
    server = Server(repo, 1, tmp_path / "state")
    try:
        chosen = (conversations * 3)[:40]
        answers = ask_all(server, "ensemble", chosen, workers=40)
        refused = [body["error"] for status, body in answers if status in (400, 503)]
        answered = [(c, body) for c, (status, body) in zip(chosen, answers, strict=True) if status == 200]
        assert len(refused) + len(answered) == len(chosen)
        full = ("Exceeds maximum queue size", "(the queue is full); retry later")  # Triton's words, the executor's
        assert refused and all(any(words in error for words in full) for error in refused), refused
        assert answered and all(body["text_output"] == c["answer"] for c, body in answered)
        status, body = server.generate("ensemble", {"text_input": chat(conversations[0]), "max_tokens": 64})
        assert status == 200 and body["text_output"] == conversations[0]["answer"]
    finally:
        server.stop()


@pytest.mark.slow
def test_a_grpc_stream_cut_by_the_servers_death_is_an_error_for_trtglms_client(tmp_path):
    """No final response means the reply is incomplete: trtglm's gRPC client raises instead of ending quietly.
    The engine's process is paused so that the request is surely in flight when tritonserver dies (the
    fixture's replies take milliseconds); test_client covers the HTTP client on a stream that breaks off."""
    pytest.importorskip("pytriton")
    import threading

    from trtglm.client import GenerateRequest, ServerError
    from trtglm.client import grpc as grpc_client

    repo = patch_repo(build_tiny_engine(tmp_path / "engine"), None, tmp_path / "repo")
    server = Server(repo, 1, tmp_path / "state")
    try:
        processes = repo_processes(repo)
        tritonserver = next(p for p in processes if p.name() == "tritonserver")
        engine = next(p for p in processes if f"{repo / 'tensorrt_llm'}/" in " ".join(p.cmdline()))
        engine.suspend()
        killer = threading.Timer(2.0, tritonserver.kill)
        killer.start()
        request = GenerateRequest("What is the capital of France?", 64, stream=True)
        with pytest.raises(ServerError):
            list(grpc_client.generate_stream(f"127.0.0.1:{server.grpc_port}", "ensemble", request, timeout=30))
        killer.join()
    finally:
        server.kill_leftovers()


@pytest.fixture(scope="module")
def reference(fixture_dir):
    """transformers' GlmForCausalLM with the fixture's weights."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.reference import load_reference
    from trtglm.chatglm.weights import HFWeights

    return load_reference(ChatGLMConfig.from_model_dir(fixture_dir), HFWeights(fixture_dir).get, torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_a_repetition_penalty_answers_as_transformers_does(server, conversations, tok, reference, model):
    """A served greedy reply with repetition_penalty is transformers' generate() with the same penalty, cut at the
    first stop id and decoded as the reply (on a conversation whose reply the penalty changes)."""
    def penalized(conversation: dict) -> str:
        prompt = chat_ids(tok, conversation["messages"])
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                     repetition_penalty=3.0, eos_token_id=list(stop_ids(tok)), pad_token_id=0)
        return reply_text(tok, out[0, len(prompt):].tolist())

    conversation, expected = next((c, text) for c in conversations for text in [penalized(c)] if text != c["answer"])
    status, body = server.generate(model, {"text_input": chat(conversation), "max_tokens": 48,
                                           "repetition_penalty": 3.0})
    assert status == 200, body
    assert body["text_output"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_max_tokens_past_max_seq_len_is_answered_as_tensorrt_llm_does(server, conversations, model):
    """Clients written for TensorRT-LLM commonly send max_tokens 1024 or more: the engine cuts it to what fits."""
    conversation = conversations[0]
    status, body = server.generate(model, {"text_input": chat(conversation), "max_tokens": 100_000})
    assert status == 200, body
    assert body["text_output"] == conversation["answer"]
