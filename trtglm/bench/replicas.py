"""`trtglm bench replicas`: what a launch of N replicas behind the front serves, at a fixed load per replica.

Against a running `launch --replicas N` (the front on --url; replica i's ports placed as launch places them, from
the front's HTTP port + 100): the streamed workload of `bench proxy` (--prompt-len ids → --new-tokens, closed loop)
at --per-replica × N in flight through the front, --requests-per-slot requests per slot, --rounds times; tokens
summed over every replica's own counters, TTFT p50/p99 from the client's traces. Results OUT/replicas.json.

    python -m trtglm.bench.replicas DEST

compares each DEST/replicas-N/replicas.json with N = 1's: tokens/s per replica count against the targets (2
replicas ≥ 1.9×, 4 ≥ 3.7×) and TTFT p99 no worse.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

from trtglm.errors import UsageError

TARGETS = {2: 1.9, 4: 3.7}  # replicas → the least tokens/s over one replica's, each at the same load per replica


def summed_counters(metrics_urls: list[str]) -> list[int]:
    from trtglm.bench import load_stats

    return [sum(values) for values in zip(*(load_stats.settled_counters(url) for url in metrics_urls))]


def measured_run(url: str, metrics_urls: list[str], model: str, workload, timeout: float,
                 fields: dict | None = None) -> tuple[dict, list]:
    """The workload streamed once through `url` (`fields` added to every request): load_stats' statistics, tokens
    summed over the servers' counters, and the client's traces."""
    from trtglm.bench import load_stats, stream_load

    before = summed_counters(metrics_urls)
    traces, seconds = stream_load.run_http(url, model, workload, timeout, fields)
    tokens, steps, step_us = (now - then for now, then in zip(summed_counters(metrics_urls), before))
    return load_stats.stats(workload, traces, seconds, tokens, steps, step_us), traces


def one_run(url: str, metrics_urls: list[str], model: str, workload, timeout: float) -> dict:
    return measured_run(url, metrics_urls, model, workload, timeout)[0]


def bench_replicas(*, url: str, replicas: int, model: str, per_replica: int, requests_per_slot: int, rounds: int,
                   prompt_len: int, new_tokens: int, seed: int, timeout: float, out: str | None) -> dict:
    from trtglm.bench.served import WARM_UP_TOKENS
    from trtglm.bench.serving import tokenizer_dir_of
    from trtglm.bench.workload import Workload, fixed_workload
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer
    from trtglm.client import http as http_client
    from trtglm.serve.command import Endpoints
    from trtglm.serve.replicas import REPLICA_PORT_OFFSET, replica_endpoints

    if min(replicas, per_replica, requests_per_slot, rounds, prompt_len, new_tokens) < 1:
        raise UsageError("--replicas, --per-replica, --requests-per-slot, --rounds, --prompt-len and --new-tokens "
                         "must be >= 1")
    front = http_client.Server.parse(url)
    block = Endpoints(front.host, front.port, 0, 0, None)
    metrics_urls = [f"http://{e.metrics_host}:{e.metrics_port}/metrics"
                    for e in (replica_endpoints(i, front.port + REPLICA_PORT_OFFSET, block) for i in range(replicas))]
    in_flight = per_replica * replicas
    workload = fixed_workload(ChatGLMTokenizer(tokenizer_dir_of(front)), requests_per_slot * in_flight, in_flight,
                              prompt_len, new_tokens, seed)
    warm = Workload("warm-up", workload.texts[:in_flight], workload.prompt_ids[:in_flight],
                    (WARM_UP_TOKENS,) * in_flight, in_flight)
    one_run(url, metrics_urls, model, warm, timeout)  # connections opened and kernels tuned stay out of the numbers
    runs = [one_run(url, metrics_urls, model, workload, timeout) for _ in range(rounds)]
    results = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "url": url, "replicas": replicas,
               "in_flight": in_flight, "model": model, "metrics_urls": metrics_urls,
               "workload": f"{prompt_len} prompt ids → {new_tokens} tokens, {requests_per_slot} requests per slot",
               "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
               "tokens_per_s_each": [round(r["tokens_per_s"], 1) for r in runs],
               "ttft_p50_ms": statistics.mean(r["ttft_ms"]["p50"] for r in runs),
               "ttft_p99_ms": statistics.mean(r["ttft_ms"]["p99"] for r in runs),
               "failed": sum(r["failed"] for r in runs)}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "replicas.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{replicas} replica(s), {in_flight} in flight: {results['tokens_per_s']:,.0f} tokens/s "
          f"({', '.join(f'{t:,.0f}' for t in results['tokens_per_s_each'])}), "
          f"TTFT p50 {results['ttft_p50_ms']:.1f} ms, p99 {results['ttft_p99_ms']:.1f} ms, {results['failed']} failed",
          flush=True)
    return results


def report(dest: Path) -> list[str]:
    """A table of every DEST/replicas-N/replicas.json against N = 1's."""
    found = {}
    for path in sorted(dest.glob("replicas-*/replicas.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        found[result["replicas"]] = result
    one = found.get(1)
    lines = ["| replicas | in flight | tokens/s | vs 1 replica | target | TTFT p50 ms | TTFT p99 ms | p99 no worse "
             "| failed |", "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for count, r in sorted(found.items()):
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}×" if one and one["tokens_per_s"] else "–"
        target = f"≥ {TARGETS[count]}×" if count in TARGETS else ""
        p99 = ("yes" if r["ttft_p99_ms"] <= one["ttft_p99_ms"] else "NO") if one and count > 1 else ""
        lines.append(f"| {count} | {r['in_flight']} | {r['tokens_per_s']:,.0f} | {ratio} | {target} | "
                     f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {p99} | {r['failed']} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="replica scaling from DEST/replicas-N/replicas.json")
    parser.add_argument("dest", type=Path)
    print("\n".join(report(parser.parse_args(argv).dest)))


if __name__ == "__main__":
    main()
