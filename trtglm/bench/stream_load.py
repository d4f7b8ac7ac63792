"""Streaming load on a served repository, and the same workload on the engine in-process.

A workload is a list of requests (a prompt text and a max_tokens each) run as a closed loop:
`concurrency` requests in flight, the next one sent as one finishes (as `inflight_run` in
runtime.py drives the executor). Three ways to run it, one function each:

- `run_http`: `POST /v2/models/MODEL/generate_stream` with `"stream": true`, server-sent events
  read as they arrive (trtglm.client.http's connection and event parser), one thread per
  request in flight;
- `run_grpc`: tritonclient's bidirectional gRPC stream (as trtglm.client.grpc does), one
  client and stream per thread, reused for that thread's requests;
- `run_in_process`: the same prompts (the ids the repository's preprocessing makes of each
  text, with its end id and stop words) submitted straight to an `Executor`, the one
  `trtglm.serve.engine.ServedEngine` runs on its own thread in the server.

Each request's trace holds its send time and one time per generated token; the statistics are
those of `inflight_run` (`inflight_stats`: TTFT from the send to the first token, inter-token
gaps within a request, p50/p99 by `_percentile`), so served and in-process numbers mean the
same. Tokens per response: trtglm's runtime returns `output_log_probs` with one value per new
token in every response (zeros unless log-probs are asked for), and the ensemble passes each
response on, so its count is exact. tensorrt_llm_bls sends a response only when its text
grows (a byte piece of a split character, a special id, text after a stop id send nothing),
with the last engine response's log-probs: there each event counts as one token and
merged ones are missed. The server's own count (`trtglm_generated_tokens_total` on the metrics
endpoint, before and after a run) is exact for both, and is the one tokens/s uses when given.

Random weights (synth-model) emit random ids and may stop early at `end_id` or a stop word
(`<|user|>`, `<|observation|>`), which preprocessing always adds: requests are not forced to
their max_tokens, and every count here is of tokens actually generated.

Prompts: `prompt_text` builds, from the tokenizer's own pieces, a text whose chat prompt
(`[gMASK] sop <|user|> \\n … <|assistant|>`, as preprocessing builds it) has exactly the asked
number of ids; the actual counts are recorded with the workload.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from trtglm.bench.measure import inflight_stats
from trtglm.client import GenerateRequest, ServerError, check_model, one_line
from trtglm.client import grpc as grpc_client
from trtglm.client import http as http_client
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback must not go through a proxy
CLOSE_TIMEOUT_S = 30.0  # for the gRPC streams of a run to close
METRIC_TOKENS = "trtglm_generated_tokens_total"
METRIC_ACTIVE = "trtglm_active_sequences"
METRIC_QUEUED = "trtglm_queued_requests"
METRIC_STEPS = "trtglm_decode_steps_total"
METRIC_STEP_TIME = "trtglm_step_microseconds_total"
METRICS_PERIOD_S = 0.5  # triton_model.Metrics refreshes the counters this often


# --- workloads ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests to run as a closed loop of `concurrency` in flight."""

    name: str
    texts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]  # what preprocessing makes of each text
    max_tokens: tuple[int, ...]
    concurrency: int

    @property
    def requests(self) -> int:
        return len(self.texts)

    def describe(self) -> dict:
        lengths = [len(ids) for ids in self.prompt_ids]
        return {"name": self.name, "requests": self.requests, "concurrency": self.concurrency,
                "prompt_tokens": {"total": sum(lengths), "min": min(lengths), "max": max(lengths)},
                "max_tokens": {"total": sum(self.max_tokens), "min": min(self.max_tokens),
                               "max": max(self.max_tokens)}}


def piece_pool(tokenizer) -> list[str]:
    """The tokenizer's ordinary pieces as text (no control, unknown or byte pieces, nothing JSON-like)."""
    sp = tokenizer.sp
    pool = []
    for i in range(sp.vocab_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        piece = sp.id_to_piece(i).replace("\u2581", " ")
        if piece.strip() and not any(c in piece for c in "{[\\\"\n\r\t") and "\ufffd" not in piece:
            pool.append(piece)
    if not pool:
        raise UsageError("the tokenizer has no ordinary pieces to build prompts from")
    return pool


def prompt_text(tokenizer, target: int, rng: random.Random, pool: Sequence[str] | None = None) -> str:
    """A text whose chat prompt (preprocessing's ids) has `target` ids, or as close as the pieces allow."""
    from trtglm.chatglm.chat import prompt_ids

    pool = pool or piece_pool(tokenizer)
    count = lambda text: len(prompt_ids(tokenizer, text))  # noqa: E731
    overhead = count("a") - len(tokenizer.sp.encode("a"))
    if target <= overhead:
        raise UsageError(f"a prompt needs more than the chat template's {overhead} ids, not {target}")
    text = ""
    while True:
        text += "".join(rng.choice(pool) for _ in range(target))
        text = text.lstrip()
        while text and not text[0].isalnum():
            text = text[1:]
        if text and count(text) >= target:
            break
    low, high = 1, len(text)  # the shortest prefix with at least `target` ids
    while low < high:
        middle = (low + high) // 2
        if count(text[:middle]) >= target:
            high = middle
        else:
            low = middle + 1
    best = text[:low]
    for k in range(low, max(0, low - 8), -1):  # a prefix that lands exactly (tokens may merge as text grows)
        if text[:k].strip() and count(text[:k]) == target:
            return text[:k]
    return best


def _workload(name: str, tokenizer, lengths: list[int], outputs: list[int], concurrency: int,
              rng: random.Random) -> Workload:
    from trtglm.chatglm.chat import prompt_ids

    pool = piece_pool(tokenizer)
    texts = [prompt_text(tokenizer, n, rng, pool) for n in tqdm(lengths, desc=f"{name}: prompts", unit="prompt",
                                                               disable=None, leave=False)]
    ids = tuple(tuple(prompt_ids(tokenizer, text)) for text in texts)
    off = sum(len(i) != n for i, n in zip(ids, lengths))
    if off:
        log.warning("%s: %d of %d prompts could not be built to their exact length", name, off, len(texts))
    return Workload(name, tuple(texts), ids, tuple(outputs), concurrency)


def fixed_workload(tokenizer, requests: int, concurrency: int, prompt_len: int, new_tokens: int,
                   seed: int = 0) -> Workload:
    """`requests` prompts of `prompt_len` ids (chat template included), `new_tokens` each."""
    _check_counts(requests, concurrency)
    return _workload(f"fixed {prompt_len}/{new_tokens}", tokenizer, [prompt_len] * requests, [new_tokens] * requests,
                     concurrency, random.Random(seed))


def mixed_workload(tokenizer, requests: int, concurrency: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int], seed: int = 0) -> Workload:
    """Prompt and output lengths uniform over the inclusive ranges (as `inflight_run` draws them)."""
    _check_counts(requests, concurrency)
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_range) for _ in range(requests)]
    outputs = [rng.randint(*output_range) for _ in range(requests)]
    return _workload(f"mixed {prompt_range[0]}-{prompt_range[1]}/{output_range[0]}-{output_range[1]}", tokenizer,
                     lengths, outputs, concurrency, rng)


def _check_counts(requests: int, concurrency: int) -> None:
    for name, value in (("requests", requests), ("concurrency", concurrency)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"--{name} must be a whole number ≥ 1, not {value!r}")


# --- one request as the client saw it --------------------------------------------------------------------


@dataclass
class Trace:
    submitted: float = 0.0
    times: list[float] = field(default_factory=list)  # one per generated token (several per response share it)
    events: int = 0  # responses that carried tokens or text
    error: str | None = None

    def add(self, now: float, tokens: int) -> None:
        self.events += 1
        self.times.extend([now] * tokens)


def tokens_in(log_probs, text) -> int:
    """Tokens in one response: its output_log_probs' length (see the module docstring), else 1 for new text."""
    if log_probs is None:
        return 1 if text else 0
    if isinstance(log_probs, (list, tuple)):
        return sum(tokens_in(item, "") if isinstance(item, (list, tuple)) else 1 for item in log_probs)
    size = getattr(log_probs, "size", None)
    return int(size) if size is not None else 1


def closed_loop(workload: Workload, send: Callable[[int, Trace], None], label: str,
                threads: Callable[[], None] | None = None) -> tuple[list[Trace], float]:
    """Run every request through `send(index, trace)` with `concurrency` threads; (traces, wall seconds)."""
    traces = [Trace() for _ in range(workload.requests)]
    pending = iter(range(workload.requests))
    lock = threading.Lock()
    bar = tqdm(total=workload.requests, desc=label, unit="req", disable=None)

    silent = threading.Event()  # a request got no answer within the timeout: the server is stuck

    def worker() -> None:
        while not silent.is_set():
            with lock:
                index = next(pending, None)
            if index is None:
                return
            try:
                send(index, traces[index])
            except NoAnswer as e:  # waiting out the timeout for every request left would take hours
                traces[index].error = one_line(str(e))
                silent.set()
            except Exception as e:  # a failed request is counted; the load goes on
                traces[index].error = one_line(str(e) or type(e).__name__)
            with lock:
                bar.update()

    workers = [threading.Thread(target=worker, name=f"load-{i}", daemon=True)
               for i in range(min(workload.concurrency, workload.requests))]
    start = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - start
    bar.close()
    for trace in traces:
        if silent.is_set() and trace.error is None and not trace.submitted:
            trace.error = "not sent: the server stopped answering"
    return traces, elapsed


class NoAnswer(ServerError):
    """No response within the run's timeout."""


def run_http(url: str, model: str, workload: Workload, timeout: float = 600.0) -> tuple[list[Trace], float]:
    """The workload over HTTP `generate_stream` (server-sent events), a new connection per request."""
    server, path = http_client.Server.parse(url), f"/v2/models/{check_model(model)}/generate_stream"

    def send(index: int, trace: Trace) -> None:
        body = json.dumps({"text_input": workload.texts[index], "max_tokens": workload.max_tokens[index],
                           "stream": True}, ensure_ascii=False).encode("utf-8")
        trace.submitted = time.perf_counter()
        try:
            _stream_http(server, path, body, timeout, model, trace)
        except TimeoutError:
            raise NoAnswer(f"no answer from Triton at {url} within {timeout:g} s") from None

    return closed_loop(workload, send, f"{workload.name}: {model} http")


def _stream_http(server, path: str, body: bytes, timeout: float, model: str, trace: Trace) -> None:
    with server.request("POST", path, body, timeout) as response:
        if response.status != 200:
            raise ServerError(http_client._error_message(model, response.status,
                                                         http_client._read(server, response)))
        for data in http_client.sse_data(http_client._lines(server, response)):
            now = time.perf_counter()
            event = http_client._json_object(model, data.encode("utf-8"))
            if "error" in event:
                raise ServerError(one_line(event["error"]))
            text = event.get("text_output")
            tokens = tokens_in(event.get("output_log_probs"), text)
            if tokens or text:
                trace.add(now, tokens)


def run_grpc(address: str, model: str, workload: Workload, timeout: float = 600.0) -> tuple[list[Trace], float]:
    """The workload over tritonclient's gRPC stream: one client and stream per thread, reused."""
    grpcclient, server_exception = grpc_client._tritonclient()
    address, model = grpc_client.check_address(address), check_model(model)
    probe = grpcclient.InferenceServerClient(address)
    try:
        batched = grpc_client._batched(probe, address, model, server_exception)
    finally:
        probe.close()
    outputs = [grpcclient.InferRequestedOutput("text_output"), grpcclient.InferRequestedOutput("output_log_probs")]
    local, opened, free = threading.local(), [], queue.Queue()

    def open_stream() -> tuple[object, queue.Queue]:
        client, responses = grpcclient.InferenceServerClient(address), queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
        opened.append(client)
        return client, responses

    for _ in range(min(workload.concurrency, workload.requests)):  # streams open before the clock starts
        free.put(open_stream())

    def stream() -> tuple[object, queue.Queue]:
        if getattr(local, "client", None) is None:
            local.client, local.responses = free.get() if not free.empty() else open_stream()
        return local.client, local.responses

    def send(index: int, trace: Trace) -> None:
        client, responses = stream()
        request = GenerateRequest(workload.texts[index], workload.max_tokens[index], stream=True)
        request_id = str(index)
        trace.submitted = time.perf_counter()
        client.async_stream_infer(model, grpc_client._inputs(grpcclient, request, batched), request_id=request_id,
                                  outputs=outputs, enable_empty_final_response=True)
        while True:
            try:
                now, result, error = responses.get(timeout=timeout)
            except queue.Empty:
                local.client = None  # a stream that went quiet is not reused
                raise NoAnswer(f"no answer from Triton at {address} within {timeout:g} s") from None
            if error is not None:
                local.client = None  # its stream may still carry this request's responses
                raise ServerError(f"{model}: {one_line(error.message())}")
            if result.get_response().id != request_id:
                continue  # a late response of an earlier request of this thread
            text = grpc_client._text(result)
            tokens = tokens_in(result.as_numpy("output_log_probs"), text)
            if tokens or text:
                trace.add(now, tokens)
            if grpc_client._is_final(result):
                return

    try:
        return closed_loop(workload, send, f"{workload.name}: {model} grpc")
    finally:
        _close_streams(opened, CLOSE_TIMEOUT_S)


def _close_streams(clients: list, timeout: float) -> None:
    """Stop and close tritonclient streams, waiting at most `timeout` s in all (stop_stream joins a thread that
    waits for the server to end the stream, forever if it never does)."""

    def close(client) -> None:
        try:
            client.stop_stream()
        finally:
            client.close()

    threads = [threading.Thread(target=close, args=(client,), daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        log.warning("%d gRPC streams did not close within %g s", sum(t.is_alive() for t in threads), timeout)


def run_in_process(executor, workload: Workload, end_id: int | None, stop_words: list[list[int]],
                   timeout: float = 3600.0) -> tuple[list[Trace], float]:
    """The workload's prompt ids submitted to `executor` (running on its own thread), a new request as one
    finishes, with the repository's end id and stop words."""
    from trtglm.runtime.request import Request

    traces = [Trace() for _ in range(workload.requests)]
    pending = iter(range(workload.requests))
    lock, all_done = threading.Lock(), threading.Event()
    left = [workload.requests]
    bar = tqdm(total=workload.requests, desc=f"{workload.name}: in-process", unit="req", disable=None)

    def finished_one() -> None:
        bar.update()
        left[0] -= 1
        if left[0] == 0:
            all_done.set()

    def submit_next() -> None:
        with lock:
            index = next(pending, None)
        if index is None:
            return
        trace = traces[index]

        def on_output(output, trace=trace) -> None:
            now = time.perf_counter()
            if output.tokens:
                trace.add(now, len(output.tokens))
            if output.error:
                trace.error = output.error
            if output.finished:
                finished_one()
                submit_next()

        trace.submitted = time.perf_counter()
        try:
            executor.submit(Request(list(workload.prompt_ids[index]), workload.max_tokens[index], end_id=end_id,
                                    stop_words=stop_words), on_output)
        except Exception as e:
            trace.error = one_line(str(e))
            finished_one()
            submit_next()

    start = time.perf_counter()
    for _ in range(min(workload.concurrency, workload.requests)):
        submit_next()
    if not all_done.wait(timeout):
        raise ServerError(f"the in-process run did not finish within {timeout:g} s")
    elapsed = time.perf_counter() - start
    bar.close()
    return traces, elapsed


# --- statistics and the server's counters ---------------------------------------------------------------


def stats(workload: Workload, traces: list[Trace], elapsed: float, server_tokens: int | None = None,
          decode_steps: int | None = None, step_us: int | None = None) -> dict:
    """`inflight_stats` of the run, with failures, response counts, the server's token count and the engine's
    decode steps (their mean time: whether the engine itself slowed, or only the responses lagged) and the share
    of the run it spent stepping (below 100 %: it waited for requests)."""
    ok = [i for i, trace in enumerate(traces) if trace.error is None]
    result = inflight_stats(workload.requests, workload.concurrency,
                             [len(ids) for ids in workload.prompt_ids], list(workload.max_tokens),
                             {i: traces[i].submitted for i in ok}, {i: traces[i].times for i in ok}, elapsed)
    result["failed"] = workload.requests - len(ok)
    result["errors"] = sorted({traces[i].error for i in range(workload.requests) if traces[i].error})[:5]
    result["requests_per_s"] = len(ok) / elapsed if elapsed > 0 else None
    result["events"] = sum(traces[i].events for i in ok)
    result["client_tokens"] = result["generated_tokens"]
    result["short_requests"] = sum(len(traces[i].times) < workload.max_tokens[i] for i in ok)
    if server_tokens is not None and server_tokens != result["client_tokens"]:
        result["short_requests"] = None  # the client missed tokens (merged events): per-request counts unknown
    if server_tokens is not None:
        result["server_tokens"] = server_tokens
        result["generated_tokens"] = server_tokens
        result["tokens_per_s"] = server_tokens / elapsed if elapsed > 0 else None
    if decode_steps:
        result["decode_steps"] = decode_steps
        result["ms_per_decode_step"] = 1000 * elapsed / decode_steps
    if step_us is not None and elapsed > 0:
        result["engine_busy_pct"] = 100 * step_us / 1e6 / elapsed
    return result


def read_metrics(metrics_url: str, timeout: float = 10.0) -> dict[str, float]:
    """trtglm's gauges and counters from Triton's metrics endpoint (Prometheus text)."""
    try:
        with NO_PROXY.open(metrics_url, timeout=timeout) as reply:
            lines = reply.read().decode("utf-8", errors="replace").splitlines()
    except OSError as e:
        raise ServerError(f"cannot read the metrics at {metrics_url}: {e}") from None
    values = {}
    for line in lines:
        if line.startswith("trtglm_"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0].strip()] = float(value)
    return values


def settled_tokens(metrics_url: str, timeout: float = 30.0) -> int:
    """The server's generated-token counter once nothing runs or waits and the counters caught up."""
    return settled_counters(metrics_url, timeout)[0]


def settled_counters(metrics_url: str, timeout: float = 30.0) -> tuple[int, int, int]:
    """The server's generated-token, decode-step and step-time counters once nothing runs or waits and they
    caught up."""
    deadline = time.monotonic() + timeout
    values = read_metrics(metrics_url)
    while (values.get(METRIC_ACTIVE) or values.get(METRIC_QUEUED)) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = read_metrics(metrics_url)
    time.sleep(2 * METRICS_PERIOD_S + 0.1)
    values = read_metrics(metrics_url)
    if METRIC_TOKENS not in values:
        raise ServerError(f"{metrics_url} has no {METRIC_TOKENS} (not trtglm's runtime behind tensorrt_llm?)")
    return int(values[METRIC_TOKENS]), int(values.get(METRIC_STEPS, 0)), int(values.get(METRIC_STEP_TIME, 0))
