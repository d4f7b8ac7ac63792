"""`trtglm bench serving`: what Triton adds to trtglm's runtime, and generated tokens/s when served.

Against a launched model repository (`trtglm launch`), two measurements:

1. Overhead. One prompt and max_tokens, one request at a time, `repeats` times each: the
   `POST /v2/models/{model}/generate` round trip (trtglm's HTTP client, a new connection per
   request) and a call of the same engine in this process doing what the repository's
   python models do (prompt ids → greedy generation → reply text), in alternating blocks so
   that load from elsewhere falls on both alike. Median and p90 of each and their
   difference: HTTP, JSON, Triton's scheduling, the ensemble's three models and the tensors
   passed between their processes.
2. Throughput. At each concurrency level, `requests` requests (at least as many as the level)
   from that many threads, each sending its next request when the previous one is answered.
   Generated tokens/s = reply tokens × replies / wall time, with requests/s and latency.

The in-process side is the server's own engine object (trtglm.backend.engine.ServedEngine:
executor, slot model, torch threads). Reply tokens are counted by the in-process run (the
tokens the engine returns: a stop word counts, end_id does not); greedy decoding is
deterministic, so each served reply is checked to be that same text (a differing reply is
counted and reported). The engine folder (checkpoint and tokenizer for the in-process run)
is the one the server's tensorrt_llm model names, unless --engine-dir says otherwise.

Random weights (`trtglm synth-model`) emit random ids, whose replies are no text to compare:
`--compare-replies=False` leaves the comparisons out (the served replies are then not checked,
only timed), and `--concurrency none` skips the throughput part.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from trtglm.client import GenerateRequest, ServerError, check_model
from trtglm.client import http as http_client
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

BLOCK = 5  # calls in a row on one side when measuring the overhead


@dataclass(frozen=True)
class ServingSettings:
    url: str
    model: str
    prompt: str
    max_tokens: int
    concurrency: tuple[int, ...]
    requests: int
    repeats: int
    engine_dir: str | None
    device: str | None  # None: as the server picks it: $TRTGLM_DEVICE, else a GPU if any, else the CPU
    timeout: float
    compare_replies: bool  # False for random weights: replies are timed, not compared

    def command(self) -> str:
        """The `trtglm bench serving` command line that gives these settings."""
        args = ["trtglm", "bench", "serving", "--url", self.url, "--model", self.model, "--prompt", self.prompt,
                "--max-tokens", str(self.max_tokens), "--concurrency", ",".join(map(str, self.concurrency)),
                "--requests", str(self.requests), "--repeats", str(self.repeats)]
        if not self.concurrency:
            args[args.index("--concurrency") + 1] = "none"
        if self.engine_dir:
            args += ["--engine-dir", self.engine_dir]
        if not self.compare_replies:
            args.append("--compare-replies=False")
        return shlex.join(args)


def parse_concurrency(value: str | int | tuple | list) -> tuple[int, ...]:
    """`1,8,32` (or one number) → (1, 8, 32); each level a whole number ≥ 1; `none` → () (no throughput part)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return ()
    parts = value if isinstance(value, (tuple, list)) else str(value).split(",")
    try:
        levels = tuple(int(str(part).strip()) for part in parts)
    except ValueError:
        levels = ()
    if not levels or any(level < 1 for level in levels):
        raise UsageError(f"--concurrency must be whole numbers ≥ 1 separated by commas, not {value!r}")
    return levels


# --- the in-process runtime ---------------------------------------------------------------------------


class InProcess:
    """The engine as the server's tensorrt_llm model runs it (trtglm.backend.engine.ServedEngine: the
    same executor and slot model), called here with the repository's prompt, stop-word and reply rules."""

    def __init__(self, engine_dir: Path, device: str | None, tokenizer_dir: str | Path | None = None):
        """`tokenizer_dir`: the one the repository's preprocessing uses (default: the engine's own)."""
        from trtglm.chatglm.chat import stop_sequences
        from trtglm.chatglm.tokenizer import ChatGLMTokenizer
        from trtglm.engine.manifest import read_manifest
        from trtglm.runtime.distributed import RankInfo
        from trtglm.backend.engine import ServedEngine

        self.manifest = read_manifest(engine_dir)
        self.tokenizer = ChatGLMTokenizer(tokenizer_dir or self.manifest.tokenizer_dir)
        self.engine = ServedEngine(engine_dir, info=RankInfo(0, 1, 0, 1), device=device)
        self.stop_words = stop_sequences(self.tokenizer, ())

    def answer(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        """(reply text, tokens the engine returned: a stop word counts, end_id does not)."""
        from trtglm.chatglm.chat import prompt_ids, reply_text
        from trtglm.runtime.request import Request

        outputs = []
        request = Request(prompt_ids(self.tokenizer, prompt), max_tokens=max_tokens,
                          end_id=self.tokenizer.eos_id, stop_words=self.stop_words)
        self.engine.executor.submit(request, outputs.append).done.wait()
        if outputs and outputs[-1].error:
            raise ServerError(f"the in-process runtime failed: {outputs[-1].error}")
        ids = [token for output in outputs for token in output.tokens]
        return reply_text(self.tokenizer, ids), len(ids)

    def close(self) -> None:
        self.engine.close()


def engine_dir_of(server: http_client.Server) -> Path:
    """The engine folder the server's tensorrt_llm model was configured with (gpt_model_path)."""
    config = server.get_json("/v2/models/tensorrt_llm/config")
    path = config.get("parameters", {}).get("gpt_model_path", {}).get("string_value")
    if not path:
        raise UsageError("the server's tensorrt_llm model names no gpt_model_path: pass --engine-dir")
    if not Path(path).is_dir():
        raise UsageError(f"the server's engine folder {path} is not on this machine: pass --engine-dir")
    return Path(path)


def tokenizer_dir_of(server: http_client.Server) -> str | None:
    """The tokenizer folder of the server's preprocessing model when it is on this machine (else None: the
    engine's own)."""
    try:
        config = server.get_json("/v2/models/preprocessing/config")
    except ServerError:
        return None
    path = config.get("parameters", {}).get("tokenizer_dir", {}).get("string_value")
    return path if path and Path(path).is_dir() else None


# --- measurements -------------------------------------------------------------------------------------


def timed(call: Callable[[], str]) -> tuple[float, str]:
    start = time.perf_counter()
    text = call()
    return time.perf_counter() - start, text


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000.0
    return {"median": round(float(np.median(ms)), 2), "p90": round(float(np.percentile(ms, 90)), 2),
            "mean": round(float(ms.mean()), 2), "min": round(float(ms.min()), 2), "max": round(float(ms.max()), 2)}


def measure_overhead(settings: ServingSettings, runtime: InProcess, expected: str) -> dict:
    """Round trips through the server and in-process calls, same prompt and max_tokens, one at a time.

    The two run in alternating blocks of BLOCK calls (the order swapped every round), so load
    from elsewhere on the machine falls on both alike; blocks rather than single calls because
    torch's idle worker threads keep spinning for a while after a call, which would slow the
    other side's next call.
    """
    request = GenerateRequest(settings.prompt, settings.max_tokens)
    calls = {"served": lambda: http_client.generate(settings.url, settings.model, request, settings.timeout),
             "in_process": lambda: runtime.answer(settings.prompt, settings.max_tokens)[0]}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    differing = dict.fromkeys(calls, 0)
    rounds = -(-settings.repeats // BLOCK)
    block_medians: dict[str, list[float]] = {name: [] for name in calls}
    with tqdm(total=2 * rounds * BLOCK, desc="overhead (served and in-process blocks)", unit="req",
              disable=None) as bar:
        for round_ in range(rounds):
            for name in (list(calls) if round_ % 2 == 0 else list(reversed(calls))):
                calls[name]()  # the first call after the other side's block is not counted
                block = []
                for _ in range(BLOCK):
                    seconds, text = timed(calls[name])
                    block.append(seconds)
                    differing[name] += settings.compare_replies and text != expected
                    bar.update()
                samples[name] += block
                block_medians[name].append(float(np.median(block)))
    results = {name: {"ms": summary_ms(samples[name]), "differing_replies": differing[name]} for name in calls}
    results["overhead_ms"] = {key: round(results["served"]["ms"][key] - results["in_process"]["ms"][key], 2)
                              for key in ("median", "p90")}
    paired = [served - local for served, local in zip(block_medians["served"], block_medians["in_process"])]
    results["overhead_ms"]["median_of_block_differences"] = summary_ms(paired)["median"]
    results["calls"] = rounds * BLOCK
    return results


def measure_throughput(settings: ServingSettings, level: int, expected: str, reply_tokens: int) -> dict:
    """`requests` served requests from `level` threads: tokens/s, requests/s, latency."""
    count = max(settings.requests, level)
    request = GenerateRequest(settings.prompt, settings.max_tokens)
    latencies, differing, errors = [], 0, []
    with ThreadPoolExecutor(max_workers=level) as pool, \
            tqdm(total=count, desc=f"throughput: concurrency {level}", unit="req", disable=None) as bar:
        start = time.perf_counter()
        futures = [pool.submit(timed, lambda: http_client.generate(settings.url, settings.model, request,
                                                                   settings.timeout))
                   for _ in range(count)]
        for future in as_completed(futures):
            try:
                seconds, text = future.result()
            except ServerError as e:
                errors.append(str(e))
            else:
                latencies.append(seconds)
                differing += settings.compare_replies and text != expected
            bar.update()
        wall = time.perf_counter() - start
    if not latencies:
        raise ServerError(f"every request failed at concurrency {level}: {errors[0]}")
    return {"concurrency": level, "requests": count, "failed": len(errors), "differing_replies": differing,
            "wall_s": round(wall, 3), "requests_per_s": round(len(latencies) / wall, 2),
            "tokens_per_s": round(reply_tokens * len(latencies) / wall, 1), "latency_ms": summary_ms(latencies)}


# --- the run ------------------------------------------------------------------------------------------


def machine() -> dict:
    import psutil
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "cpu": cpu,
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_1min": round(os.getloadavg()[0], 2)}


def bench_serving(settings: ServingSettings, out: str | Path | None) -> dict:
    """Run both measurements; results as a dict (written as serving.json and serving.md under `out`)."""
    server = http_client.Server.parse(settings.url)
    check_model(settings.model)
    triton = server.get_json("/v2")
    engine_dir = Path(settings.engine_dir) if settings.engine_dir else engine_dir_of(server)
    log.info("loading %s for the in-process runs", engine_dir)
    runtime = InProcess(engine_dir, settings.device, tokenizer_dir_of(server))
    try:
        results = _measure(settings, runtime, triton, engine_dir)
    finally:
        runtime.close()
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "serving.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
        (folder / "serving.md").write_text(markdown(results))
        log.info("wrote %s and %s", folder / "serving.json", folder / "serving.md")
    return results


def _measure(settings: ServingSettings, runtime: InProcess, triton: dict, engine_dir: Path) -> dict:
    expected, reply_tokens = runtime.answer(settings.prompt, settings.max_tokens)
    served = http_client.generate(settings.url, settings.model, GenerateRequest(settings.prompt, settings.max_tokens),
                                  settings.timeout)
    if settings.compare_replies and served != expected:
        log.warning("the server answers %r, the in-process runtime %r: token counts are the runtime's",
                    served, expected)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": settings.command(),
        "machine": machine(),
        "server": {"url": settings.url, "model": settings.model, "triton": triton.get("version"),
                   "engine_dir": str(engine_dir), "engine": runtime.manifest.engine,
                   "dtype": runtime.manifest.dtype, "limits": asdict(runtime.manifest.limits)},
        "prompt": settings.prompt, "max_tokens": settings.max_tokens, "reply": expected,
        "reply_tokens": reply_tokens, "served_reply_matches": served == expected,
        "replies_compared": settings.compare_replies,
        "overhead": measure_overhead(settings, runtime, expected),
        "throughput": [measure_throughput(settings, level, expected, reply_tokens) for level in settings.concurrency],
    }


def markdown(results: dict) -> str:
    """The results as the tables of docs/benchmarks.md's serving section."""
    m, o = results["machine"], results["overhead"]
    lines = [f"Measured {results['date']} on {m['nproc']} CPU cores ({m['cpu']}), {m['memory_gib']} GiB memory, "
             f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), Triton "
             f"{results['server']['triton']}; {results['server']['engine']} engine, {results['server']['dtype']}; "
             f"load average {m['load_average_1min']} when it started.",
             "", "```", results["command"], "```", "",
             f"Prompt {results['prompt']!r}, max_tokens {results['max_tokens']}: "
             + (f"reply {results['reply']!r} " if results.get("replies_compared", True) else
                "replies not compared (random weights), ")
             + f"({results['reply_tokens']} generated tokens in-process).", "",
             f"Overhead, one request at a time ({o['calls']} calls each, in alternating blocks of {BLOCK}):", "",
             "| path | median ms | p90 ms |", "|---|---:|---:|",
             f"| HTTP generate through `{results['server']['model']}` | {o['served']['ms']['median']} | "
             f"{o['served']['ms']['p90']} |",
             f"| runtime in-process (prompt ids → generate → text) | {o['in_process']['ms']['median']} | "
             f"{o['in_process']['ms']['p90']} |",
             f"| **Triton overhead** (difference) | **{o['overhead_ms']['median']}** | "
             f"**{o['overhead_ms']['p90']}** |",
             "", f"Median of the differences between the blocks' medians (served − in-process, "
             f"{o['calls'] // BLOCK} block pairs): {o['overhead_ms']['median_of_block_differences']} ms."]
    if results["throughput"]:
        lines += ["", "Throughput through the server:", "",
                  "| concurrency | requests | generated tokens/s | requests/s | latency median ms | latency p90 ms |",
                  "|---:|---:|---:|---:|---:|---:|"]
    for row in results["throughput"]:
        lines.append(f"| {row['concurrency']} | {row['requests']} | {row['tokens_per_s']} | {row['requests_per_s']} "
                     f"| {row['latency_ms']['median']} | {row['latency_ms']['p90']} |")
    problems = [f"{o[name]['differing_replies']} differing {name.replace('_', '-')} replies"
                for name in ("served", "in_process") if o[name]["differing_replies"]]
    problems += [f"{row['failed']} failed and {row['differing_replies']} differing replies at concurrency "
                 f"{row['concurrency']}" for row in results["throughput"] if row["failed"] or row["differing_replies"]]
    if problems:
        lines += ["", "Problems: " + "; ".join(problems) + "."]
    return "\n".join(lines) + "\n"


def check_positive(name: str, value, kind: type = int) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (kind is int and not isinstance(value, int)):
        raise UsageError(f"--{name} must be a positive {'whole number' if kind is int else 'number'}, not {value!r}")
