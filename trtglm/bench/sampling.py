"""`trtglm bench sampling`: what each way of choosing tokens costs, next to greedy in the same run.

The cases (`CASES`, one table): greedy; ChatGLM3's own defaults (temperature 0.8, top_p 0.8);
temperature 0.8 with top_k 50; greedy with log probabilities. Every case runs the same closed
loop (`concurrency` requests in flight, a new one as each finishes), in rounds that take the
cases in turn, so that a drifting machine hits them alike; a case's tokens/s is its rounds'
mean, and its ratio is against greedy's mean in the same run.

- In-process (no --url): the executor stepped on this thread, over --fixture (the portable
  runtime on the CPU, the fast one on a GPU) or random --preset weights (GPU); prompts of
  --prompt-len random ids and no end id, so every request makes exactly --new-tokens tokens.
  Wall ms per decode step = the run's seconds over the executor's decode steps.
- Served (--url and --metrics-url of a `trtglm launch`): streamed to --model's generate_stream
  over HTTP with the case's request fields (trtglm.request_config.client_inputs), prompts of
  --prompt-len ids made from the repository's tokenizer (workload.fixed_workload); tokens and
  decode steps from the server's own counters (random weights end replies early now and then,
  so the server's count is the one that holds). One unmeasured wave of every case first.

Results: OUT/sampling.json, and a table on stdout.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from trtglm.conventions import MAX_NUM_TOKENS
from trtglm.errors import UsageError
from trtglm.request_config import OutputConfig, SamplingConfig, client_inputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    sampling: SamplingConfig
    output: OutputConfig = OutputConfig()


CASES = {
    "greedy": Case(SamplingConfig()),
    "top-p": Case(SamplingConfig(temperature=0.8, top_p=0.8)),  # ChatGLM3's own defaults
    "top-k": Case(SamplingConfig(temperature=0.8, top_k=50)),
    "log-probs": Case(SamplingConfig(), OutputConfig(return_log_probs=True)),
}
BASELINE = "greedy"


def parse_cases(value: str | list | tuple) -> list[str]:
    names = [str(v).strip() for v in (value if isinstance(value, (list, tuple)) else str(value).split(",")) if str(v)]
    if not names or any(name not in CASES for name in names) or BASELINE not in names:
        raise UsageError(f"--cases takes names from {', '.join(CASES)} and includes {BASELINE}, not {value!r}")
    return names


# --- in-process ---------------------------------------------------------------------------------------------------


def in_process_run(model, case: Case, requests: int, concurrency: int, prompt_len: int, new_tokens: int,
                   seed: int, device: torch.device) -> dict:
    """One closed loop of the executor over `model`, every request with `case`'s settings (seeds differ)."""
    from trtglm.runtime.executor import Executor
    from trtglm.runtime.request import Request

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.vocab_size, (requests, prompt_len), generator=generator).tolist()
    executor = Executor(model, max_queue=requests, max_num_tokens=MAX_NUM_TOKENS, device=device)
    pending = iter(range(requests))

    def submit_next(_output=None) -> None:
        if _output is not None and not _output.finished:
            return
        index = next(pending, None)
        if index is not None:
            sampling = case.sampling if case.sampling.greedy else _seeded(case.sampling, seed + index)
            executor.submit(Request(prompts[index], new_tokens, sampling=sampling, output=case.output), submit_next)

    start = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        submit_next()
    while executor.has_work():
        executor.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stats = executor.stats()
    return {"seconds": seconds, "generated_tokens": stats.generated_tokens, "decode_steps": stats.decode_calls,
            "tokens_per_s": stats.generated_tokens / seconds, "ms_per_decode_step": 1e3 * seconds / stats.decode_calls}


def _seeded(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    return replace(sampling, seed=seed)


def in_process(fixture: str | None, preset: str, cases: list[str], rounds: int, requests: int, concurrency: int,
               prompt_len: int, new_tokens: int, seed: int) -> dict:
    from trtglm.bench.inflight import _model

    device = _device()
    with tempfile.TemporaryDirectory() as work:
        model, name = _model(fixture, preset, "none", concurrency, prompt_len + new_tokens + 64, device, Path(work))
        in_process_run(model, CASES[BASELINE], concurrency, concurrency, prompt_len, 2, seed, device)  # warm-up
        runs = _rounds(cases, rounds, lambda case, r: in_process_run(
            model, CASES[case], requests, concurrency, prompt_len, new_tokens, seed + 1000 * r, device))
    return {"where": "in-process", "model": name, "device": _device_name(device), "runs": runs}


# --- served -------------------------------------------------------------------------------------------------------


def served_run(url: str, metrics_url: str, model: str, workload, case: Case, timeout: float) -> dict:
    """The workload streamed with `case`'s fields; tokens and decode steps from the server's counters."""
    from trtglm.bench import load_stats, stream_load

    fields = {name: value for name, (value, _) in client_inputs(case.sampling, case.output).items()}
    before = load_stats.settled_counters(metrics_url), load_stats.decode_only_counts(metrics_url)
    traces, seconds = stream_load.run_http(url, model, workload, timeout, fields)
    tokens, steps, step_us = (now - then for now, then in zip(load_stats.settled_counters(metrics_url), before[0]))
    only_steps, only_us = (now - then for now, then in zip(load_stats.decode_only_counts(metrics_url), before[1]))
    failed = sum(trace.error is not None for trace in traces)
    return {"seconds": seconds, "generated_tokens": tokens, "decode_steps": steps, "failed": failed,
            "errors": sorted({t.error for t in traces if t.error})[:3], "tokens_per_s": tokens / seconds,
            "ms_per_decode_step": 1e3 * seconds / steps if steps else None,
            "ms_per_decode_only_step": only_us / 1e3 / only_steps if only_steps else None,
            "engine_busy_pct": 100 * step_us / 1e6 / seconds}


def served(url: str, metrics_url: str, model: str, cases: list[str], rounds: int, requests: int, concurrency: int,
           prompt_len: int, new_tokens: int, seed: int, timeout: float) -> dict:
    from trtglm.bench.served import WARM_UP_TOKENS
    from trtglm.bench.serving import tokenizer_dir_of
    from trtglm.bench.workload import Workload, fixed_workload
    from trtglm.chatglm.tokenizer import ChatGLMTokenizer
    from trtglm.client import http as http_client

    server = http_client.Server.parse(url)
    tokenizer = ChatGLMTokenizer(tokenizer_dir_of(server))
    workload = fixed_workload(tokenizer, requests, concurrency, prompt_len, new_tokens, seed)
    wave = min(concurrency, requests)
    warm = Workload("warm-up", workload.texts[:wave], workload.prompt_ids[:wave], (WARM_UP_TOKENS,) * wave, wave)
    for case in cases:  # kernels compiled or tuned on first use stay out of the numbers
        served_run(url, metrics_url, model, warm, CASES[case], timeout)
    runs = _rounds(cases, rounds, lambda case, _: served_run(url, metrics_url, model, workload, CASES[case], timeout))
    return {"where": f"served: {model} over HTTP streaming", "url": url, "device": _device_name(_device()),
            "workload": workload.describe(), "triton": server.get_json("/v2").get("version"), "runs": runs}


# --- both ---------------------------------------------------------------------------------------------------------


def _rounds(cases: list[str], rounds: int, run) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for r in range(rounds):
        for case in cases:
            result = run(case, r)
            log.info("round %d, %s: %.1f tokens/s", r + 1, case, result["tokens_per_s"])
            runs[case].append(result)
    return runs


def summarised(results: dict) -> dict:
    """Each case's mean tokens/s and wall ms per decode step, and its ratio to greedy's."""
    cases = {}
    for case, runs in results["runs"].items():
        steps = [r["ms_per_decode_step"] for r in runs if r["ms_per_decode_step"]]
        alone = [r["ms_per_decode_only_step"] for r in runs if r.get("ms_per_decode_only_step")]
        cases[case] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in runs),
                       "tokens_per_s_each": [round(r["tokens_per_s"], 1) for r in runs],
                       "ms_per_decode_step": statistics.mean(steps) if steps else None,
                       "ms_per_decode_only_step": statistics.mean(alone) if alone else None,
                       "failed": sum(r.get("failed", 0) for r in runs)}
    base = cases[BASELINE]["tokens_per_s"]
    for case in cases.values():
        case["vs_greedy"] = case["tokens_per_s"] / base if base else None
    return {**results, "cases": cases}


def table(results: dict) -> str:
    lines = [f"sampling cost, {results['where']} ({results.get('model') or results.get('url')}, "
             f"{results.get('device', '')}):", "",
             "| case | request settings | tokens/s (each round) | wall ms per decode step | ms per decode-only step "
             "| vs greedy | failed |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, case in results["cases"].items():
        fields = client_inputs(CASES[name].sampling, CASES[name].output)
        settings = ", ".join(f"{k} {v}" for k, (v, _) in fields.items()) or "none (greedy)"
        step, alone = (f"{case[key]:.2f}" if case.get(key) else "–"
                       for key in ("ms_per_decode_step", "ms_per_decode_only_step"))
        lines.append(f"| {name} | {settings} | {case['tokens_per_s']:,.0f} "
                     f"({', '.join(f'{t:,.0f}' for t in case['tokens_per_s_each'])}) | {step} | {alone} | "
                     f"{case['vs_greedy']:.2f}× | {case['failed']} |")
    return "\n".join(lines) + "\n"


def bench_sampling(*, url: str | None, metrics_url: str | None, model: str, fixture: str | None, preset: str,
                   cases: str, rounds: int, requests: int, concurrency: int, prompt_len: int, new_tokens: int,
                   seed: int, timeout: float, out: str | None) -> dict:
    names = parse_cases(cases)
    if min(rounds, requests, concurrency, prompt_len, new_tokens) < 1:
        raise UsageError("--rounds, --requests, --concurrency, --prompt-len and --new-tokens must be >= 1")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if url is not None:
        if not metrics_url:
            raise UsageError("a served run counts tokens with the server's counters: give --metrics-url too")
        results = served(url, metrics_url, model, names, rounds, requests, concurrency, prompt_len, new_tokens, seed,
                         timeout)
    else:
        results = in_process(fixture, preset, names, rounds, requests, concurrency, prompt_len, new_tokens, seed)
    results = summarised({"date": started, "settings": {"rounds": rounds, "requests": requests,
                                                        "concurrency": concurrency, "prompt_len": prompt_len,
                                                        "new_tokens": new_tokens, "seed": seed}, **results})
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "sampling.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(table(results), end="", flush=True)
    return results


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device_name(device: torch.device) -> str:
    """The GPU's name, else the CPU's (what the numbers were measured on)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return "CPU"
