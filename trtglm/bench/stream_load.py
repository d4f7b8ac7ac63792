"""Streaming load on a served repository, and the same workload on the engine in-process.

A workload (workload.py) is a list of requests (a prompt text and a max_tokens each) run as a
closed loop: `concurrency` requests in flight, the next one sent as one finishes (as
`inflight_run` in inflight.py drives the executor). Three ways to run it, one function each:

- `run_http`: `POST /v2/models/MODEL/generate_stream` with `"stream": true`, server-sent events
  read as they arrive (trtglm.client.http's connection and event parser), one thread per
  request in flight;
- `run_grpc`: tritonclient's bidirectional gRPC stream (as trtglm.client.grpc does), one
  client and stream per thread, reused for that thread's requests;
- `run_in_process`: the same prompts (the ids the repository's preprocessing makes of each
  text, with its end id and stop words) submitted straight to an `Executor`, the one
  `trtglm.backend.engine.ServedEngine` runs on its own thread in the server.

Each request's trace holds its send time and one time per generated token; load_stats.py
turns the traces into statistics. Tokens per response: trtglm's runtime returns
`output_log_probs` with one value per new token in every response (zeros unless log-probs are
asked for), and the ensemble passes each response on, so its count is exact.
tensorrt_llm_bls sends a response only when its text grows (a byte piece of a split
character, a special id, text after a stop id send nothing), with the last engine response's
log-probs: there each event counts as one token and merged ones are missed (the server's own
count, load_stats.py, is exact for both).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from trtglm.bench.workload import Workload
from trtglm.client import ANSWER_TIMEOUT_S, GenerateRequest, ServerError, check_model, one_line
from trtglm.client import grpc as grpc_client
from trtglm.client import http as http_client

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # for the gRPC streams of a run to close


# --- one request as the client saw it --------------------------------------------------------------------


PERF_TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns")  # return_perf_metrics' times


@dataclass
class Trace:
    submitted: float = 0.0
    times: list[float] = field(default_factory=list)  # one per generated token (several per response share it)
    events: int = 0  # responses that carried tokens or text
    error: str | None = None
    # time.time_ns(), the clock of the server's perf metrics: at the send and at the first event with tokens
    sent_ns: int = 0
    first_event_ns: int = 0
    server_ns: dict[str, int] | None = None  # PERF_TIMES of the first event, when the request asked for them

    def add(self, now: float, tokens: int) -> None:
        if not self.events:
            self.first_event_ns = time.time_ns()
        self.events += 1
        self.times.extend([now] * tokens)

    def add_perf(self, event: dict) -> None:
        """The first token's perf metrics from a response that carries them (HTTP's JSON numbers or lists)."""
        if self.server_ns is None and all(name in event for name in PERF_TIMES):
            self.server_ns = {name: int(_first(event[name])) for name in PERF_TIMES}


def _first(value):
    while isinstance(value, (list, tuple)):
        value = value[0]
    return value


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


def run_http(url: str, model: str, workload: Workload, timeout: float = ANSWER_TIMEOUT_S,
             fields: dict | None = None) -> tuple[list[Trace], float]:
    """The workload over HTTP `generate_stream` (server-sent events), a new connection per request; `fields`:
    more request fields for every request (e.g. sampling settings)."""
    server, path = http_client.Server.parse(url), f"/v2/models/{check_model(model)}/generate_stream"

    def send(index: int, trace: Trace) -> None:
        body = json.dumps({"text_input": workload.texts[index], "max_tokens": workload.max_tokens[index],
                           "stream": True, **(fields or {})}, ensure_ascii=False).encode("utf-8")
        trace.submitted, trace.sent_ns = time.perf_counter(), time.time_ns()
        try:
            _stream_http(server, path, body, timeout, model, trace)
        except TimeoutError:
            raise NoAnswer(f"no answer from Triton at {url} within {timeout:g} s") from None

    return closed_loop(workload, send, f"{workload.name}: {model} http")


def _stream_http(server, path: str, body: bytes, timeout: float, model: str, trace: Trace) -> None:
    with server.request("POST", path, body, timeout) as response:
        if response.status != 200:
            raise ServerError(http_client.error_message(model, response.status,
                                                         http_client.read_body(server, response)))
        for data in http_client.sse_data(http_client.event_lines(server, response)):
            now = time.perf_counter()
            event = http_client.json_object(model, data.encode("utf-8"))
            if "error" in event:
                raise ServerError(one_line(event["error"]))
            text = event.get("text_output")
            tokens = tokens_in(event.get("output_log_probs"), text)
            if tokens or text:
                trace.add(now, tokens)
                trace.add_perf(event)


def run_grpc(address: str, model: str, workload: Workload,
             timeout: float = ANSWER_TIMEOUT_S) -> tuple[list[Trace], float]:
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
