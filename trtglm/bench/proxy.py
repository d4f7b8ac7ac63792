"""`trtglm bench proxy`: what the front (Envoy, serve/front.py) costs a launch, against its replica's own port.

One launch with the front (`launch --front`, one replica) is reached two ways: through the front's HTTP
port (--url) and straight at the replica's (--direct-url; by default replica 0's port when the replicas' ports
start at the front's HTTP port + 100, as launch places them). The
same streamed workload (stream_load.run_http to --model's generate_stream: --requests prompts of
--prompt-len ids, --new-tokens each, a closed loop at each --concurrency) runs through each in
alternating rounds (front first in odd rounds, direct first in even ones), so that a drifting machine
hits both alike. Tokens come from the server's own counters (load_stats), TTFT from the client's
traces (send to first token). The targets: through the front, at least TOKENS_TARGET of the direct
tokens/s and at most TTFT_TARGET_MS more TTFT p50.

Results: OUT/proxy.json, and a table on stdout.
"""

from __future__ import annotations

import json
import logging
import statistics
from datetime import datetime, timezone
from pathlib import Path

from trtglm.bench.replicas import one_run
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

TOKENS_TARGET = 0.97  # of the direct tokens/s, through the front
TTFT_TARGET_MS = 2.0  # more TTFT p50 through the front, at most
ROUTES = ("front", "direct")


def parse_levels(value) -> list[int]:
    levels = [value] if isinstance(value, int) else [v for v in str(value).replace(" ", "").split(",") if v]
    try:
        parsed = [int(v) for v in levels]
    except ValueError:
        parsed = []
    if not parsed or min(parsed) < 1:
        raise UsageError(f"--concurrency takes whole numbers ≥ 1, comma-separated, not {value!r}")
    return parsed


def level_runs(urls: dict[str, str], metrics_url: str, model: str, workload, rounds: int, timeout: float) -> dict:
    """Each route's runs at one concurrency, in alternating order."""
    runs: dict[str, list[dict]] = {route: [] for route in urls}
    for r in range(rounds):
        for route in (ROUTES if r % 2 == 0 else ROUTES[::-1]):
            result = one_run(urls[route], [metrics_url], model, workload, timeout)
            log.info("concurrency %d, round %d, %s: %.0f tokens/s, TTFT p50 %.1f ms", workload.concurrency, r + 1,
                     route, result["tokens_per_s"], result["ttft_ms"]["p50"])
            runs[route].append(result)
    return runs


def summary(runs: dict[str, list[dict]]) -> dict:
    """Each route's mean tokens/s, TTFT p50/p99 and failures, and the front against direct."""
    routes = {route: {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in found),
                      "tokens_per_s_each": [round(r["tokens_per_s"], 1) for r in found],
                      "ttft_p50_ms": statistics.mean(r["ttft_ms"]["p50"] for r in found),
                      "ttft_p99_ms": statistics.mean(r["ttft_ms"]["p99"] for r in found),
                      "failed": sum(r["failed"] for r in found), "errors": sorted({e for r in found for e in r["errors"]})}
              for route, found in runs.items()}
    front, direct = routes["front"], routes["direct"]
    ratio = front["tokens_per_s"] / direct["tokens_per_s"] if direct["tokens_per_s"] else None
    extra_ttft = front["ttft_p50_ms"] - direct["ttft_p50_ms"]
    return {**routes, "tokens_ratio": ratio, "ttft_p50_extra_ms": extra_ttft,
            "met": ratio is not None and ratio >= TOKENS_TARGET and extra_ttft <= TTFT_TARGET_MS
            and front["failed"] == direct["failed"] == 0}


def table(results: dict) -> str:
    lines = [f"the front's cost ({results['url']} against {results['direct_url']}, {results['workload']}):", "",
             "| in flight | route | tokens/s (each round) | TTFT p50 ms | TTFT p99 ms | failed |",
             "|---:|---|---:|---:|---:|---:|"]
    for level, found in results["levels"].items():
        for route in ROUTES:
            row = found[route]
            lines.append(f"| {level} | {route} | {row['tokens_per_s']:,.0f} "
                         f"({', '.join(f'{t:,.0f}' for t in row['tokens_per_s_each'])}) | {row['ttft_p50_ms']:.1f} | "
                         f"{row['ttft_p99_ms']:.1f} | {row['failed']} |")
    lines.append("")
    for level, found in results["levels"].items():
        lines.append(f"at {level} in flight: the front gives {found['tokens_ratio']:.1%} of direct tokens/s "
                     f"(target ≥ {TOKENS_TARGET:.0%}), TTFT p50 {found['ttft_p50_extra_ms']:+.2f} ms "
                     f"(target ≤ +{TTFT_TARGET_MS:g} ms): {'met' if found['met'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


def bench_proxy(*, url: str, direct_url: str | None, metrics_url: str | None, model: str, concurrency, requests_per_slot: int,
                rounds: int, prompt_len: int, new_tokens: int, seed: int, timeout: float, out: str | None) -> dict:
    from trtglm.bench.served import WARM_UP_TOKENS
    from trtglm.bench.serving import tokenizer_dir_of
    from trtglm.bench.workload import Workload, fixed_workload
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer
    from trtglm.client import http as http_client
    from trtglm.serve.command import Endpoints
    from trtglm.serve.replicas import REPLICA_PORT_OFFSET, replica_endpoints

    levels = parse_levels(concurrency)
    if min(requests_per_slot, rounds, prompt_len, new_tokens) < 1:
        raise UsageError("--requests-per-slot, --rounds, --prompt-len and --new-tokens must be >= 1")
    front = http_client.Server.parse(url)
    replica = replica_endpoints(0, front.port + REPLICA_PORT_OFFSET, Endpoints(front.host, front.port, 0, 0, None))
    direct_url = direct_url or f"http://{replica.host}:{replica.http_port}"
    metrics_url = metrics_url or f"http://{replica.metrics_host}:{replica.metrics_port}/metrics"
    urls = {"front": url, "direct": direct_url}
    tokenizer = ChatGLMTokenizer(tokenizer_dir_of(front))
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    results = {"date": started, "url": url, "direct_url": direct_url, "metrics_url": metrics_url, "model": model,
               "levels": {}}
    for level in levels:
        workload = fixed_workload(tokenizer, requests_per_slot * level, level, prompt_len, new_tokens, seed)
        warm = Workload("warm-up", workload.texts[:level], workload.prompt_ids[:level], (WARM_UP_TOKENS,) * level, level)
        for route_url in urls.values():  # connections opened and kernels tuned stay out of the numbers
            one_run(route_url, [metrics_url], model, warm, timeout)
        results["workload"] = f"{prompt_len} prompt ids → {new_tokens} tokens, {requests_per_slot} requests per slot"
        results["levels"][level] = summary(level_runs(urls, metrics_url, model, workload, rounds, timeout))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "proxy.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(table(results), end="", flush=True)
    return results
