"""`trtglm bench latency`: where a streamed request's time goes when the server is full.

Against a running launch (--url, --metrics-url): the streamed workload of `bench proxy` (--prompt-len ids →
--new-tokens, a closed loop, --requests-per-slot requests per slot) at each --concurrency, for each sampling case of
--cases, every request asking for NVIDIA's perf metrics (`return_perf_metrics`: when the tensorrt_llm model got it,
when the engine gave it a slot, when its first token left for the client). Each run gives:

- tokens/s (the server's counters), TTFT p50/p99 (send → first token), the gap between stream events p50/p99 and the
  tokens an event carries. TTFT again without the first wave: a closed loop opens with every slot's prompt sent at
  once, a burst whose prefill the last of them waits for (256 prompts of 128 ids are 32,768 prompt tokens);
  the requests after it arrive as others end;
- genai-perf's inter-token latency beside them: per request, (last token − first token) / (tokens − 1), p50/p99;
- the first token's path in the parts of SEGMENTS, p50/p99/mean each, on the clock that the client and the server's
  processes share on one machine (time.time_ns); the parts' means add up to the mean TTFT on that clock.

Results: OUT/latency.json, and a table with each figure against TARGETS (those of a full server).
"""

from __future__ import annotations

import json
import logging
import statistics
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

from trtglm.bench.measure import percentile
from trtglm.bench.stream_load import Trace
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

# (part of the first token's path, its start and end among a trace's times: the send, the perf metrics, the event)
SEGMENTS = (("HTTP, ensemble, preprocessing", "sent", "arrival_time_ns"),
            ("to the engine, waiting for a slot", "arrival_time_ns", "first_scheduled_time_ns"),
            ("prompt pass, choice, hand-out", "first_scheduled_time_ns", "first_token_time_ns"),
            ("postprocessing, ensemble, SSE", "first_token_time_ns", "first_event"))
# in flight -> (figure, its most): a full server's targets
TARGETS = {256: {"ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0, "event_gap_p99_ms": 100.0},
           64: {"ttft_p99_ms": 120.0}}
FIGURES = (("tokens_per_s", "tokens/s", "{:,.0f}"),  # (key of a run, column, format)
           ("ttft_p50_ms", "TTFT p50", "{:.1f}"), ("ttft_p99_ms", "TTFT p99", "{:.1f}"),
           ("ttft_later_p50_ms", "TTFT p50 after the first wave", "{:.1f}"),
           ("ttft_later_p99_ms", "TTFT p99 after the first wave", "{:.1f}"),
           ("event_gap_p50_ms", "event gap p50", "{:.1f}"), ("event_gap_p99_ms", "event gap p99", "{:.1f}"),
           ("tokens_per_event", "tokens per event", "{:.2f}"),
           ("itl_p50_ms", "ITL p50 (genai-perf)", "{:.2f}"), ("itl_p99_ms", "ITL p99 (genai-perf)", "{:.2f}"))


def stream_figures(traces: list[Trace]) -> dict:
    """Event gaps, tokens per event and genai-perf's inter-token latency of the answered requests' traces."""
    gaps, itl = [], []
    for trace in traces:
        events = [t for i, t in enumerate(trace.times) if i == 0 or t != trace.times[i - 1]]
        gaps += [(b - a) * 1e3 for a, b in pairwise(events)]
        if len(trace.times) > 1:
            itl.append((trace.times[-1] - trace.times[0]) * 1e3 / (len(trace.times) - 1))
    events, tokens = sum(t.events for t in traces), sum(len(t.times) for t in traces)
    return {"event_gap_p50_ms": percentile(gaps, 50), "event_gap_p99_ms": percentile(gaps, 99),
            "tokens_per_event": tokens / events if events else None,
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99)}


def breakdown(traces: list[Trace]) -> dict:
    """Each part of SEGMENTS in ms (p50, p99, mean) over the traces that carry the server's perf metrics, and how
    many did."""
    points = [{"sent": t.sent_ns, **t.server_ns, "first_event": t.first_event_ns} for t in traces
              if t.server_ns and t.first_event_ns and all(t.server_ns.values())]
    parts = {}
    for name, start, end in SEGMENTS:
        values = [(p[end] - p[start]) / 1e6 for p in points]
        parts[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99),
                       "mean": statistics.mean(values) if values else None}
    return {"traced": len(points), "parts": parts}


def one_run(url: str, metrics_url: str, model: str, workload, fields: dict, timeout: float) -> dict:
    from trtglm.bench.replicas import measured_run

    result, traces = measured_run(url, [metrics_url], model, workload, timeout, {**fields, "return_perf_metrics": True})
    answered = [trace for trace in traces if trace.error is None]
    later = [(t.times[0] - t.submitted) * 1e3 for t in traces[workload.concurrency:] if t.error is None and t.times]
    return {"tokens_per_s": result["tokens_per_s"], "ttft_p50_ms": result["ttft_ms"]["p50"],
            "ttft_p99_ms": result["ttft_ms"]["p99"], "ttft_later_p50_ms": percentile(later, 50),
            "ttft_later_p99_ms": percentile(later, 99), **stream_figures(answered), "failed": result["failed"],
            "errors": result["errors"], "engine_busy_pct": result.get("engine_busy_pct"),
            "first_token": breakdown(answered)}


def bench_latency(*, url: str, metrics_url: str, model: str, concurrency: str, cases: str, requests_per_slot: int,
                  prompt_len: int, new_tokens: int, seed: int, timeout: float, out: str | None) -> dict:
    from trtglm.bench.proxy import parse_levels
    from trtglm.bench.sampling import CASES, parse_cases
    from trtglm.bench.served import WARM_UP_TOKENS
    from trtglm.bench.serving import tokenizer_dir_of
    from trtglm.bench.workload import Workload, fixed_workload
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer
    from trtglm.client import http as http_client
    from trtglm.request_config import client_inputs

    levels, names = parse_levels(concurrency), parse_cases(cases)
    if min(requests_per_slot, prompt_len, new_tokens) < 1:
        raise UsageError("--requests-per-slot, --prompt-len and --new-tokens must be >= 1")
    tokenizer = ChatGLMTokenizer(tokenizer_dir_of(http_client.Server.parse(url)))
    runs = {}
    for level in levels:
        workload = fixed_workload(tokenizer, requests_per_slot * level, level, prompt_len, new_tokens, seed)
        warm = Workload("warm-up", workload.texts[:level], workload.prompt_ids[:level], (WARM_UP_TOKENS,) * level,
                        level)
        one_run(url, metrics_url, model, warm, {}, timeout)  # connections and kernels stay out of the numbers
        for name in names:
            fields = {key: value for key, (value, _) in client_inputs(CASES[name].sampling, CASES[name].output).items()}
            runs[f"{level} {name}"] = {"in_flight": level, "case": name,
                                      **one_run(url, metrics_url, model, workload, fields, timeout)}
            log.info("%d in flight, %s: %.0f tokens/s, TTFT p50 %.1f ms", level, name,
                     runs[f"{level} {name}"]["tokens_per_s"], runs[f"{level} {name}"]["ttft_p50_ms"])
    results = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "url": url, "model": model,
               "workload": f"{prompt_len} prompt ids → {new_tokens} tokens, {requests_per_slot} requests per slot",
               "runs": runs}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "latency.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(table(results), end="", flush=True)
    return results


def table(results: dict) -> str:
    """One row per run: each figure (with its target where a full server has one), then the first token's parts."""
    lines = [f"latency under load ({results['url']}, {results['model']}, {results['workload']}):", "",
             "| in flight | case | " + " | ".join(label for _, label, _ in FIGURES) + " | failed |",
             "|---:|---|" + "---:|" * (len(FIGURES) + 1)]
    for run in results["runs"].values():
        targets = TARGETS.get(run["in_flight"], {})
        cells = [_cell(run[key], form, targets.get(key)) for key, _, form in FIGURES]
        lines.append(f"| {run['in_flight']} | {run['case']} | " + " | ".join(cells) + f" | {run['failed']} |")
    lines += ["", "the first token's path, ms (p50 / p99 / mean):", "",
              "| in flight | case | traced | " + " | ".join(name for name, _, _ in SEGMENTS) + " |",
              "|---:|---|---:|" + "---:|" * len(SEGMENTS)]
    for run in results["runs"].values():
        found = run["first_token"]
        parts = [" / ".join("–" if v is None else f"{v:.1f}" for v in found["parts"][name].values())
                 for name, _, _ in SEGMENTS]
        lines.append(f"| {run['in_flight']} | {run['case']} | {found['traced']} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, form: str, most: float | None) -> str:
    if value is None:
        return "–"
    text = form.format(value)
    return text if most is None else f"{text} ({'met' if value <= most else 'NOT met'}: ≤ {most:g})"
