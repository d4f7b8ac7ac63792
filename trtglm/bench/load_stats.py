"""Statistics of a streamed load run (stream_load.py) and the server's own counters.

The statistics are those of `inflight_run` (inflight.py; measure.py's `inflight_stats`: TTFT from the send
to the first token, inter-token gaps within a request, p50/p99), so served and in-process
numbers mean the same. The server's own count (`trtglm_generated_tokens_total` on the metrics
endpoint, read before and after a run once it settled) is exact for every model, and is the one
tokens/s uses when given; the client's count misses tokens that tensorrt_llm_bls merged into one
event.
"""

from __future__ import annotations

import time

from trtglm.bench.measure import inflight_stats
from trtglm.bench.stream_load import Trace
from trtglm.bench.workload import Workload
from trtglm.client import NO_PROXY, ServerError

METRIC_TOKENS = "trtglm_generated_tokens_total"
METRIC_ACTIVE = "trtglm_active_sequences"
METRIC_QUEUED = "trtglm_queued_requests"
METRIC_STEPS = "trtglm_decode_steps_total"
METRIC_STEP_TIME = "trtglm_step_microseconds_total"
METRIC_DECODE_ONLY = ("trtglm_decode_only_steps_total", "trtglm_decode_only_step_microseconds_total")
METRICS_PERIOD_S = 0.5  # triton_model.Metrics refreshes the counters this often


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


def decode_only_counts(metrics_url: str) -> tuple[int, int]:
    """The server's count of steps of decode tokens alone and their microseconds (0, 0 from a server without them)."""
    values = read_metrics(metrics_url)
    return tuple(int(values.get(name, 0)) for name in METRIC_DECODE_ONLY)


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
