"""NVIDIA's own v0.19.0 clients, run unchanged against repositories rendered from trtglm's template and
patched from NVIDIA's v0.19.0 (the fixture engine, served by `trtglm launch` as in test_serving):
end_to_end_grpc_client.py on the reply of `ensemble` and `tensorrt_llm_bls`, streamed and not, with and
without --exclude-input-in-output, and with --batch-inputs (several prompts in one request, each answered
under its batch_index; refused where tensorrt_llm is not decoupled), checked by the client's own
--check-outputs against the fixture's exact answers (the client adds the prompt itself where NVIDIA's output
holds it: not streamed and not excluded);
inflight_batcher_llm_client.py on the `tensorrt_llm` model with token ids, its own --check-output against
the fixture's answer ids, and --return-log-probs, --return-context-logits and --return-generation-logits
against transformers' GlmForCausalLM. A tp-2 engine served by two ranks gives both clients the same exact
answers, in trtglm's layout and NVIDIA's v0.19.0 one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED
from support.cli_calls import patch_repo
from support.engines import build_tiny_engine
from support.nvidia import v1_2_1_copy
from support.references import glm_reference, greedy_with_logits  # noqa: F401 (fixture)
from trtglm.chatglm.chat import chat_ids, prompt_ids
from trtglm.chatglm.fast_tokenizer import write_fast_tokenizer
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from support.servers import Server, fixture_answers

UPSTREAM = SHARED / "upstream/tensorrtllm_backend-v0.19.0"
CLIENT = UPSTREAM / "clients/inflight_batcher_llm/client/end_to_end_grpc_client.py"
IDS_CLIENT = UPSTREAM / "clients/inflight_batcher_llm/client/inflight_batcher_llm_client.py"
TOOLS = UPSTREAM / "clients/tools"  # its scripts import `utils` from here
pytestmark = pytest.mark.skipif(not CLIENT.is_file(), reason=f"NVIDIA's clients are not here: {UPSTREAM}")
USER = 518  # <|user|>: the fixture's answers end there (ChatGLM3's stop token)
TEMPLATES = {"trtglm": lambda root: None,  # trtglm's own
             "nvidia-v0.19.0": lambda root: UPSTREAM / "inflight_batcher_llm",
             "nvidia-v1.2.1": v1_2_1_copy}  # root -> the template


@pytest.fixture(scope="module", params=TEMPLATES, ids=list(TEMPLATES))
def server(request, tmp_path_factory):
    if not CLIENT.is_file():
        pytest.skip(f"NVIDIA's client is not here: {CLIENT}")
    pytest.importorskip("tritonclient.grpc")
    root = tmp_path_factory.mktemp("nvidia-clients")
    engine = build_tiny_engine(root / "engine", tp=1)
    server = Server(patch_repo(engine, None, root / "repo", template=TEMPLATES[request.param](root)), 1, root / "state")
    server.layout = request.param
    yield server
    server.stop()


@pytest.fixture(scope="module")
def conversation(fixture_dir) -> dict:
    """A plain-text question (the client's prompt is one user message) whose answer has spaces."""
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    return next(c for c in map(json.loads, lines) if c["messages"][0]["content"] == "What color is the sky?")


def run_client(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLIENT), "-u", f"127.0.0.1:{server.grpc_port}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("exclude", [False, True], ids=["with-input", "without-input"])
def test_end_to_end_grpc_client_checks_the_fixtures_answer(server, conversation, model, streaming, exclude):
    question = conversation["messages"][0]["content"]
    flags = ["--streaming"] * streaming + ["--exclude-input-in-output"] * exclude
    run = run_client(server, "--model-name", model, "-p", question, "-o", "64", "--check-outputs",
                     "--expected-outputs", json.dumps([conversation["answer"]]), *flags)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error" not in run.stdout, run.stdout
    # what the client printed of the reply: the prompt before it exactly when not streamed and not excluded
    shown = question + conversation["answer"] if not (streaming or exclude) else conversation["answer"]
    assert shown in run.stdout, run.stdout


BATCH = ["What color is the sky?", "What color is grass?", "How many legs does a cat have?"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_end_to_end_grpc_client_batch_inputs_check_each_prompts_answer(server, model, streaming):
    """--batch-inputs: the three prompts in one request; the client files each response's text under its
    batch_index and --check-outputs compares each prompt's with the fixture's answer to it."""
    expected = [fixture_answers()[question] for question in BATCH]
    run = run_client(server, "--model-name", model, "-p", json.dumps(BATCH), "-o", "64", "--batch-inputs",
                     "--check-outputs", "--expected-outputs", json.dumps(expected), *["--streaming"] * streaming)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error" not in run.stdout, run.stdout
    for index, (question, answer) in enumerate(zip(BATCH, expected)):
        # whole: each response printed as it came, "batch_index: text"; streamed: each text at the end
        assert (f"{index}: {question}{answer}\n" if not streaming else f"\n{answer}\n") in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_grpc_client_batch_inputs_need_a_decoupled_repository(whole_server, model):
    """Not decoupled, tensorrt_llm refuses a batch in NVIDIA's words, and the server goes on."""
    run = run_client(whole_server, "--model-name", model, "-p", json.dumps(BATCH[:2]), "-o", "64", "--batch-inputs")
    assert "Received an error from server" in run.stdout, run.stdout + run.stderr
    assert "Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy" in run.stdout
    answer = fixture_answers()[BATCH[0]]
    run = run_client(whole_server, "--model-name", model, "-p", BATCH[0], "-o", "64", "--exclude-input-in-output",
                     "--check-outputs", "--expected-outputs", json.dumps([answer]))
    assert run.returncode == 0 and "Received an error" not in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_gives_the_prompt_before_the_reply_only_when_asked(server, conversation, model):
    """HTTP generate shows one sequence's text_output as a plain string; the prompt comes first only for
    exclude_input_in_output false (left out, it is true)."""
    question, answer = conversation["messages"][0]["content"], conversation["answer"]
    for exclude, expected in ((False, question + answer), (True, answer), (None, answer)):
        body = {"text_input": question, "max_tokens": 64}
        if exclude is not None:
            body["exclude_input_in_output"] = exclude
        status, reply = server.generate(model, body)
        assert (status, reply.get("text_output")) == (200, expected), (exclude, reply)


def answer_ids(fixture_dir, conversation) -> tuple[list[int], list[int]]:
    """The chat prompt's ids and the fixture's exact answer ids (ChatGLM3's "\\n" metadata line, then the
    answer; the <|user|> that ends it is the end id below, so not returned)."""
    tok = ChatGLMTokenizer(fixture_dir)
    return chat_ids(tok, conversation["messages"]), tok.sp.encode("\n") + tok.sp.encode(conversation["answer"])


def csv(path: Path, ids: list[int]) -> Path:
    path.write_text(",".join(map(str, ids)) + "\n")
    return path


@pytest.fixture(scope="module")
def whole_server(tmp_path_factory):
    """trtglm's template with decoupled_mode false: Triton answers a plain (not streamed) gRPC infer only there."""
    root = tmp_path_factory.mktemp("nvidia-clients-whole")
    engine = build_tiny_engine(root / "engine", tp=1, **{"serve.decoupled": False})
    server = Server(patch_repo(engine, None, root / "repo"), 1, root / "state")
    yield server
    server.stop()


# The client sends num_return_sequences over its streaming API, so those go to decoupled repositories too.
STREAMED = {"streamed": ["--streaming", "--exclude-input-in-output"],
            "streamed-2-sequences": ["--streaming", "--exclude-input-in-output", "--num-return-sequences", "2"],
            "whole-2-sequences": ["--exclude-input-in-output", "--num-return-sequences", "2"]}
WHOLE = {"whole": [], "whole-excluded": ["--exclude-input-in-output"]}
OPEN_QUESTION = [{"role": "user", "content": "Write a poem about the moon."}]  # not one the fixture learnt


def run_ids_client(server, prompt: list[int], tmp_path, flags, answer: list[int] | None = None):
    """NVIDIA's token-level client against the tensorrt_llm model: `prompt` in; with `answer`, its own
    --check-output against it."""
    check = ["--output-tokens-csv", str(csv(tmp_path / "out.csv", answer)), "--check-output"] if answer else []
    run = subprocess.run([sys.executable, str(IDS_CLIENT), "-u", f"127.0.0.1:{server.grpc_port}",
                          "--input-tokens-csv", str(csv(tmp_path / "in.csv", prompt)), *check,
                          "--end-id", str(USER), "--pad-id", "0", "--request-output-len", "24", *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("PASS!" in run.stdout) == bool(answer), run.stdout
    return run.stdout


# The input is never part of output_ids: the repositories' exclude_input_in_output parameter is true (the client
# adds the prompt itself when streaming without --exclude-input-in-output, which NVIDIA's backend does not pass
# either). Streamed requests go to the decoupled repositories, whole ones to a repository with decoupled_mode
# false: Triton refuses a plain infer of a decoupled model.
@pytest.mark.slow
@pytest.mark.parametrize("flags", STREAMED.values(), ids=STREAMED)
def test_inflight_batcher_llm_client_streams_the_fixtures_answer_ids(server, conversation, fixture_dir, tmp_path,
                                                                      flags):
    run_ids_client(server, *answer_ids(fixture_dir, conversation)[:1], tmp_path, flags,
                   answer_ids(fixture_dir, conversation)[1])


@pytest.mark.slow
@pytest.mark.parametrize("flags", WHOLE.values(), ids=WHOLE)
def test_inflight_batcher_llm_client_gets_the_fixtures_answer_ids_whole(whole_server, conversation, fixture_dir,
                                                                         tmp_path, flags):
    prompt, answer = answer_ids(fixture_dir, conversation)
    run_ids_client(whole_server, prompt, tmp_path, flags, answer)


@pytest.mark.slow
def test_inflight_batcher_llm_client_log_probs_are_transformers_whole(whole_server, fixture_dir, tmp_path):
    """--return-log-probs on a question the fixture never learnt (so the log probabilities are far from 0): the
    ids are transformers' greedy ones, output_log_probs each one's log probability under transformers'
    GlmForCausalLM and cum_log_probs their sum."""
    log_probs, stdout = check_log_probs(whole_server, fixture_dir, tmp_path, [])
    assert printed(stdout, "output_log_probs") == pytest.approx(log_probs, abs=1e-3)


@pytest.mark.slow
def test_inflight_batcher_llm_client_log_probs_are_transformers_streamed(server, fixture_dir, tmp_path):
    """The same streamed (the client keeps each response's output_log_probs over the last, so only
    cum_log_probs covers the whole reply)."""
    check_log_probs(server, fixture_dir, tmp_path, ["--streaming"])


def check_log_probs(server, fixture_dir, tmp_path, flags) -> tuple[list[float], str]:
    prompt = chat_ids(ChatGLMTokenizer(fixture_dir), OPEN_QUESTION)
    stdout = run_ids_client(server, prompt, tmp_path, ["--exclude-input-in-output", "--return-log-probs", *flags])
    ids, log_probs = reference_reply(fixture_dir, prompt, 24)
    assert [int(x) for x in printed(stdout, "Output sequence", "[", "]")] == ids
    assert min(log_probs) < -0.05  # a check that zeros would fail
    assert printed(stdout, "cum_log_probs") == pytest.approx([sum(log_probs)], abs=1e-3)
    return log_probs, stdout


def reference_reply(fixture_dir, prompt: list[int], limit: int, end_id: int = USER) -> tuple[list[int], list[float]]:
    """transformers' GlmForCausalLM with the fixture's weights: the greedy ids up to `end_id` (not included) or
    `limit`, and each one's log probability among the ids the tokenizer has (the engine never chooses the padded
    ones past them, so they hold no probability)."""
    import torch

    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.reference import load_reference
    from trtglm.chatglm.weights import HFWeights

    model = load_reference(ChatGLMConfig.from_model_dir(fixture_dir), HFWeights(fixture_dir).get, torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False, eos_token_id=end_id,
                             pad_token_id=0)
        ids = out[0, len(prompt):].tolist()
        ids = ids[:ids.index(end_id)] if end_id in ids else ids
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    log_probs = torch.log_softmax(logits[len(prompt) - 1:-1, :ChatGLMTokenizer(fixture_dir).vocab_size], dim=-1)
    return ids, [log_probs[i, token].item() for i, token in enumerate(ids)]


def printed(stdout: str, name: str, opening: str = "[[", closing: str = "]]") -> list[float]:
    """The numbers of the array the client printed as `name: [[...]]`."""
    match = re.search(rf"^{name}:\s*({re.escape(opening)}.*?{re.escape(closing)})", stdout, re.M | re.S)
    assert match, stdout
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", match.group(1))]


def run_tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "inflight_batcher_llm" / script), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(TOOLS)})


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_end_to_end_test_chains_the_models_as_the_ensemble_and_bls_do(whole_server, dataset, protocol):
    """tools/inflight_batcher_llm/end_to_end_test.py: each fixture question through preprocessing, tensorrt_llm and
    postprocessing by hand gives the ensemble's and the BLS model's text_output, log probabilities included; then
    its timed run of every question."""
    port = whole_server.grpc_port if protocol == "grpc" else whole_server.http_port
    run = run_tool("end_to_end_test.py", "--protocol", protocol, "-u", f"127.0.0.1:{port}", "--dataset",
                   str(dataset), "--max-input-len", "300", "--test-bls", "--return-log-probs",
                   "--concurrency", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[INFO] Functionality test succeed." in run.stdout and "Total Latency" in run.stdout, run.stdout


@pytest.fixture(scope="module")
def fast_tokenizer(fixture_dir, tmp_path_factory) -> Path:
    """The fixture's tokenizer as AutoTokenizer loads it without trust_remote_code (test_fast_tokenizer.py)."""
    return write_fast_tokenizer(fixture_dir, tmp_path_factory.mktemp("fast-tokenizer"))


@pytest.fixture(scope="module")
def dataset(fixture_dir, tmp_path_factory) -> Path:
    """The fixture's one-message questions in the tools' dataset format."""
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path_factory.mktemp("dataset") / "dataset.json"
    path.write_text(json.dumps([{"input": "", "instruction": c["messages"][-1]["content"], "output": c["answer"]}
                                for c in map(json.loads, lines) if len(c["messages"]) == 1]))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_benchmark_core_model_runs_the_dataset_on_tensorrt_llm(whole_server, fast_tokenizer, dataset, protocol):
    """tools/inflight_batcher_llm/benchmark_core_model.py's dataset workload: the questions tokenized by
    transformers' AutoTokenizer (the fixture's fast tokenizer), sent to tensorrt_llm as ids. (Its
    token-norm-dist workload draws ids up to 2**31, which trtglm refuses as outside the vocabulary.)"""
    port = whole_server.grpc_port if protocol == "grpc" else whole_server.http_port
    run = run_tool("benchmark_core_model.py", "--protocol", protocol, "-u", f"127.0.0.1:{port}",
                   "--max-input-len", "300", "--num-requests", "16", "--concurrency", "4", "dataset",
                   "--dataset", str(dataset), "--tokenizer-dir", str(fast_tokenizer))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Total Latency" in run.stdout, run.stdout


@pytest.mark.slow
def test_inflight_batcher_llm_client_tokenizes_with_the_fast_tokenizer(server, fixture_dir, fast_tokenizer):
    """inflight_batcher_llm_client.py with --text and --tokenizer-dir: its end id (`</s>`) and the prompt's ids
    come from AutoTokenizer; the reply is transformers' greedy one for those ids."""
    text = "What color is the sky?"
    run = subprocess.run([sys.executable, str(IDS_CLIENT), "-u", f"127.0.0.1:{server.grpc_port}", "--streaming",
                          "--exclude-input-in-output", "--text", text, "--tokenizer-dir", str(fast_tokenizer),
                          "--request-output-len", "24"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    prompt = ChatGLMTokenizer(fixture_dir).encode(text)
    assert [int(x) for x in printed(run.stdout, "Input sequence", "[", "]")] == prompt
    ids, _ = reference_reply(fixture_dir, prompt, 24, end_id=2)
    assert [int(x) for x in printed(run.stdout, "Output sequence", "[", "]")] == ids


UNHONOURED = {"lora_task_id": (3, 0), "guided_decoding_guide": ('{"type": "object"}', ""),
              "prompt_vocab_size": (4, 0)}  # input -> (refused, neutral)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_inputs_trtglm_cannot_honour_are_refused_by_name_and_taken_when_neutral(server, conversation, model):
    question, answer = conversation["messages"][0]["content"], conversation["answer"]
    for name, (refused, neutral) in UNHONOURED.items():
        status, reply = server.generate(model, {"text_input": question, "max_tokens": 64, name: refused})
        assert status == 400 and f"{name}: trtglm's runtime has no " in reply.get("error", ""), (name, reply)
        status, reply = server.generate(model, {"text_input": question, "max_tokens": 64, name: neutral})
        assert (status, reply.get("text_output")) == (200, answer), (name, reply)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_the_token_counts_are_the_prompts_and_the_replys(server, conversation, fixture_dir, model):
    """return_num_input_tokens / return_num_output_tokens (the newest templates' outputs): the chat prompt's ids and
    the reply's, its closing <|user|> stop word included (TensorRT-LLM returns a stop word)."""
    if server.layout == "nvidia-v0.19.0":
        pytest.skip("NVIDIA's v0.19.0 layout has no token-count inputs or outputs")
    prompt, answer = answer_ids(fixture_dir, conversation)
    body = {"text_input": conversation["messages"][0]["content"], "max_tokens": 64,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    status, reply = server.generate(model, body)
    assert status == 200, reply
    assert (reply["num_input_tokens"], reply["num_output_tokens"]) == (len(prompt), len(answer) + 1)
    status, plain = server.generate(model, {k: v for k, v in body.items() if not k.startswith("return_")})
    assert status == 200 and "num_input_tokens" not in plain and "num_output_tokens" not in plain, plain


MIN_TOKENS_NAMES = {"trtglm": ("min_tokens", "min_length"), "nvidia-v0.19.0": ("min_length",),
                    "nvidia-v1.2.1": ("min_tokens",)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["min_tokens", "min_length"])
def test_min_tokens_keeps_the_end_id_away_under_either_name(server, conversation, fixture_dir, name):
    """The newest templates' min_tokens is v0.19.0's min_length: with <|user|> as the end id the fixture's answer
    ends after its ids, unless the request asks for more tokens first."""
    if name not in MIN_TOKENS_NAMES[server.layout]:
        pytest.skip(f"the {server.layout} layout has no {name}")
    prompt, answer = answer_ids(fixture_dir, conversation)
    inputs = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[32]], np.int32), "end_id": np.array([[USER]], np.int32),
              "streaming": np.array([[True]])}

    def reply(**extra) -> list[int]:
        responses = server.grpc_stream("tensorrt_llm", {**inputs, **extra})
        return [int(i) for r in responses if r.as_numpy("output_ids") is not None for i in r.as_numpy("output_ids")[0][0]]

    assert reply() == answer
    longer = reply(**{name: np.array([[len(answer) + 5]], np.int32)})
    assert longer[:len(answer)] == answer and len(longer) >= len(answer) + 5


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_perf_metrics_time_the_request_in_order(server, conversation, fixture_dir, model):
    """return_perf_metrics: arrival, slot, first and last token in that order within the request's wall-clock
    time; the KV-cache blocks of 64 (configs/tiny.yaml) its prompt and answer take, none reused (prefix caching
    is off); no draft tokens."""
    prompt, answer = answer_ids(fixture_dir, conversation)
    blocks = -(-(len(prompt) + len(answer)) // 64)
    body = {"text_input": conversation["messages"][0]["content"], "max_tokens": 64}
    before = time.time_ns()
    status, reply = server.generate(model, {**body, "return_perf_metrics": True})
    after = time.time_ns()
    assert status == 200 and reply["text_output"] == conversation["answer"], reply
    times = [reply[f"{name}_time_ns"] for name in ("arrival", "first_scheduled", "first_token", "last_token")]
    assert before <= times[0] <= times[1] <= times[2] < times[3] <= after, times
    assert [reply[name] for name in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                                     "kv_cache_alloc_total_blocks", "total_accepted_draft_tokens",
                                     "total_draft_tokens", "acceptance_rate")] == [blocks, 0, blocks, 0, 0, 0]
    status, plain = server.generate(model, body)
    assert status == 200 and "arrival_time_ns" not in plain, plain


@pytest.mark.slow
def test_inflight_batcher_llm_client_prints_the_perf_metrics(server, conversation, fixture_dir, tmp_path):
    prompt, answer = answer_ids(fixture_dir, conversation)
    stdout = run_ids_client(server, prompt, tmp_path, ["--streaming", "--exclude-input-in-output",
                                                       "--return-perf-metrics"], answer)
    times = [int(re.search(rf"^{name}_time_ns: (\d+)$", stdout, re.M).group(1))
             for name in ("arrival", "first_scheduled", "first_token", "last_token")]
    assert 0 < times[0] <= times[1] <= times[2] < times[3], stdout


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_end_to_end_grpc_client_gets_each_of_several_return_sequences(server, conversation, model, streaming):
    """--num-return-sequences 3: each sequence in responses of its own, told apart by sequence_index; greedy, so
    every one is the fixture's answer (the client's own check), with its perf metrics."""
    question = conversation["messages"][0]["content"]
    run = subprocess.run([sys.executable, str(CLIENT), "-u", f"127.0.0.1:{server.grpc_port}", "--model-name", model,
                          "-p", question, "-o", "64", "--num-return-sequences", "3", "--return-perf-metrics",
                          "--exclude-input-in-output", "--check-outputs",
                          "--expected-outputs", json.dumps([conversation["answer"]]), *["--streaming"] * streaming],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error" not in run.stdout, run.stdout
    assert all(f"0 [{index}]: {conversation['answer']}" in run.stdout for index in range(3)) or streaming, run.stdout


def reference_logits(model, fixture_dir, prompt: list[int], limit: int = 24, end_id: int = USER,
                     stops: tuple[int, ...] = ()):
    """transformers' greedy reply to `prompt` (`limit` ids at most, up to `end_id` or the first of `stops`) with
    its context and generation logits (support.references.greedy_with_logits)."""
    return greedy_with_logits(model, prompt, limit, end_id, stops, choosable=ChatGLMTokenizer(fixture_dir).vocab_size)


def check_printed_logits(stdout: str, name: str, expected: np.ndarray) -> None:
    """The client printed `name`'s shape and the array as numpy shows it (the first and last rows and columns of
    a large one): both are those of `expected` from transformers."""
    assert f"{name}.shape: {expected.shape}" in stdout, stdout
    shown = printed(stdout, name, "[" * expected.ndim, "]" * expected.ndim)
    assert shown == pytest.approx(printed(f"{name}: {expected}", name, "[" * expected.ndim, "]" * expected.ndim),
                                  abs=2e-3)
    assert max(map(abs, shown)) > 1.0  # what zeros would fail


@pytest.mark.slow
def test_inflight_batcher_llm_client_logits_are_transformers_whole(whole_server, glm_reference, fixture_dir,
                                                                    tmp_path):
    """--return-context-logits --return-generation-logits: every prompt position's logits and each generated
    id's, over the engine's padded vocabulary (576, past the tokenizer's 521 ids), as TensorRT-LLM returns them."""
    prompt = chat_ids(ChatGLMTokenizer(fixture_dir), OPEN_QUESTION)
    stdout = run_ids_client(whole_server, prompt, tmp_path, ["--exclude-input-in-output", "--return-context-logits",
                                                             "--return-generation-logits"])
    ids, context, generation = reference_logits(glm_reference, fixture_dir, prompt)
    assert [int(x) for x in printed(stdout, "Output sequence", "[", "]")] == ids
    check_printed_logits(stdout, "context_logits", context[None])
    check_printed_logits(stdout, "generation_logits", generation[None])


@pytest.mark.slow
def test_inflight_batcher_llm_client_logits_are_transformers_streamed(server, glm_reference, fixture_dir, tmp_path):
    """The same streamed: the client keeps the last response's logits, the prompt's (every response carries them)
    and those of the last response's new ids ([tokens, beam, vocab], as TensorRT-LLM streams them). 12 ids end
    the reply before its end id. Ids that pile up while a response is in flight go out together (backend/outbox.py),
    so the last response carries the last id and perhaps a few before it: the client prints each response's."""
    prompt = chat_ids(ChatGLMTokenizer(fixture_dir), OPEN_QUESTION)
    stdout = run_ids_client(server, prompt, tmp_path, ["--streaming", "--exclude-input-in-output",
                                                       "--return-context-logits", "--return-generation-logits",
                                                       "--request-output-len", "12"])
    ids, context, generation = reference_logits(glm_reference, fixture_dir, prompt, limit=12)
    assert len(ids) == 12
    responses = [json.loads(line) for line in re.findall(r"^\[[\d, ]+\]$", stdout.split("Output sequence:")[0], re.M)]
    assert [i for response in responses for i in response] == ids, stdout
    check_printed_logits(stdout, "context_logits", context[None])
    check_printed_logits(stdout, "generation_logits", generation[-len(responses[-1]):, None])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_grpc_client_prints_transformers_logits(server, glm_reference, fixture_dir, model):
    """end_to_end_grpc_client.py --verbose prints what the ensemble and the BLS model pass through."""
    tok = ChatGLMTokenizer(fixture_dir)
    question = OPEN_QUESTION[0]["content"]
    run = subprocess.run([sys.executable, str(CLIENT), "-u", f"127.0.0.1:{server.grpc_port}", "--model-name", model,
                          "-p", question, "-o", "24", "--return-context-logits", "--return-generation-logits",
                          "--verbose"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Received an error" not in run.stdout, run.stdout + run.stderr
    # the ensemble's end id is </s> (2); it stops after <|user|> or <|observation|>, which it returns
    _, context, generation = reference_logits(glm_reference, fixture_dir, prompt_ids(tok, question), end_id=2,
                                              stops=(USER, 520))
    check_printed_logits(run.stdout, "context_logits", context[None])
    check_printed_logits(run.stdout, "generation_logits", generation[None, None])


@pytest.fixture(scope="module", params=["trtglm", "nvidia-v0.19.0"])
def two_rank_server(request, tmp_path_factory):
    """A tp-2 engine served by two ranks (`trtglm launch --world-size 2`, mpirun), in trtglm's and NVIDIA's
    v0.19.0 layouts."""
    root = tmp_path_factory.mktemp("nvidia-clients-tp2")
    engine = build_tiny_engine(root / "engine", tp=2)
    server = Server(patch_repo(engine, None, root / "repo", template=TEMPLATES[request.param](root)), 2, root / "state")
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_end_to_end_grpc_client_against_two_ranks(two_rank_server, conversation, model, streaming):
    """At world size 2 the clients get the same exact answers: one prompt, then a batch of three."""
    stream = ["--streaming"] * streaming
    run = run_client(two_rank_server, "--model-name", model, "-p", conversation["messages"][0]["content"], "-o", "64",
                     "--exclude-input-in-output", "--check-outputs", "--expected-outputs",
                     json.dumps([conversation["answer"]]), *stream)
    assert run.returncode == 0 and "Received an error" not in run.stdout, run.stdout + run.stderr
    expected = [fixture_answers()[question] for question in BATCH]
    run = run_client(two_rank_server, "--model-name", model, "-p", json.dumps(BATCH), "-o", "64", "--batch-inputs",
                     "--exclude-input-in-output", "--check-outputs", "--expected-outputs", json.dumps(expected),
                     *stream)
    assert run.returncode == 0 and "Received an error" not in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_inflight_batcher_llm_client_against_two_ranks(two_rank_server, conversation, fixture_dir, tmp_path):
    prompt, answer = answer_ids(fixture_dir, conversation)
    run_ids_client(two_rank_server, prompt, tmp_path, STREAMED["streamed"], answer)
