"""`trtglm bench served`: a launched repository against the same engine in-process, streaming included.

Against a running server (`trtglm launch`), in one process that also loads the server's engine
(`InProcess`: trtglm.backend.engine.ServedEngine, the executor and slot model the
server runs, with the repository's tokenizer, end id and stop words):

1. Overhead, one request at a time (`measure_overhead`: HTTP `generate` through
   `--model` against the in-process call, alternating blocks): median and p90 ms of each, and
   Triton's overhead in ms and as % of the in-process time. Replies are not compared (random
   weights give no comparable text); the server's token counter says how many tokens each
   served call generated, next to the in-process count.
2. The fixed workload: `--requests` prompts of `--prompt-len` ids (chat template included)
   and `--new-tokens` each, `--concurrency` in flight, streamed through each of `--paths`
   (MODEL:PROTOCOL, protocol http = server-sent events, grpc = tritonclient's stream) and run
   in-process first (after an unmeasured wave of its first prompts on each side): generated
   tokens/s, requests/s, TTFT and inter-token p50/p99, and the served tokens/s as % of the
   in-process tokens/s (trtglm.bench.stream_load).
3. The mixed workload of docs/benchmarks.md (prompts uniform in --mixed-prompts, outputs in
   --mixed-outputs, --mixed-requests at --mixed-concurrency) through `--mixed-paths`, next to
   its in-process run (`--mixed-requests 0` skips it).

Results: served.json (written again after every run, so a run cut short keeps what it
measured) and served.md (served_report.py) under --out; the markdown tables are printed last.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from trtglm.bench import load_stats, stream_load
from trtglm.bench.served_report import RATIO_TARGET_PCT, markdown
from trtglm.bench.serving import (BLOCK, InProcess, check_positive, engine_dir_of, machine, measure_overhead,
                                  tokenizer_dir_of)
from trtglm.bench.serving import ServingSettings
from trtglm.bench.workload import Workload, fixed_workload, mixed_workload
from trtglm.client import ServerError, check_model
from trtglm.client import http as http_client
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
OVERHEAD_TARGET_PCT = 5.0  # Triton's overhead over the in-process call, at most
WARM_UP_TOKENS = 4  # new tokens per request of a workload's warm-up wave


@dataclass(frozen=True)
class ServedSettings:
    url: str
    grpc: str | None  # HOST:PORT; None: no gRPC paths
    metrics_url: str | None  # http://HOST:PORT/metrics; None: tokens counted by the client only
    engine_dir: str | None
    device: str | None
    repeats: int
    overhead_model: str
    overhead_prompt: str
    overhead_tokens: int
    requests: int
    concurrency: int
    prompt_len: int
    new_tokens: int
    paths: tuple[tuple[str, str], ...]
    mixed_requests: int
    mixed_concurrency: int
    mixed_prompts: tuple[int, int]
    mixed_outputs: tuple[int, int]
    mixed_paths: tuple[tuple[str, str], ...]
    seed: int
    timeout: float
    stop_after: float  # seconds after which no new run starts (0: no limit)
    extra: dict  # merged into the results (e.g. the pipeline's launch timings)

    def command(self) -> str:
        args = ["trtglm", "bench", "served", "--url", self.url]
        for flag, value in (("--grpc", self.grpc), ("--metrics-url", self.metrics_url),
                            ("--engine-dir", self.engine_dir)):
            if value:
                args += [flag, value]
        args += ["--repeats", str(self.repeats), "--overhead-tokens", str(self.overhead_tokens),
                 "--requests", str(self.requests), "--concurrency", str(self.concurrency),
                 "--prompt-len", str(self.prompt_len), "--new-tokens", str(self.new_tokens),
                 "--paths", format_paths(self.paths), "--mixed-requests", str(self.mixed_requests),
                 "--mixed-concurrency", str(self.mixed_concurrency),
                 "--mixed-prompts", f"{self.mixed_prompts[0]},{self.mixed_prompts[1]}",
                 "--mixed-outputs", f"{self.mixed_outputs[0]},{self.mixed_outputs[1]}",
                 "--mixed-paths", format_paths(self.mixed_paths), "--seed", str(self.seed)]
        return shlex.join(args)


def parse_paths(value: str | list | tuple) -> tuple[tuple[str, str], ...]:
    """`ensemble:http,tensorrt_llm_bls:grpc` → (("ensemble", "http"), ...); `none` → ()."""
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return ()
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    paths = []
    for part in parts:
        model, _, protocol = str(part).strip().partition(":")
        if protocol not in PROTOCOLS:
            raise UsageError(f"a path is MODEL:http or MODEL:grpc (e.g. ensemble:http), not {part!r}")
        paths.append((check_model(model), protocol))
    return tuple(paths)


def format_paths(paths: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{model}:{protocol}" for model, protocol in paths) or "none"


def parse_range(value: str | list | tuple, name: str) -> tuple[int, int]:
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        low, high = (int(str(p).strip()) for p in parts)
    except ValueError:
        raise UsageError(f"--{name} must be LOW,HIGH (whole numbers), not {value!r}") from None
    if not 1 <= low <= high:
        raise UsageError(f"--{name} must be LOW,HIGH with 1 ≤ LOW ≤ HIGH, not {value!r}")
    return low, high


# --- the run -----------------------------------------------------------------------------------------------


class Run:
    """The results so far, saved after every part."""

    def __init__(self, settings: ServedSettings, out: Path | None):
        self.settings, self.out = settings, out
        self.results: dict = {}
        self.counter: tuple[int, int] | None = None  # the server's token and step counts after the last served run
        self.started = time.monotonic()

    def out_of_time(self, what: str, into: list | None = None) -> bool:
        """Whether --stop-after has passed (then `what` is recorded as skipped)."""
        limit = self.settings.stop_after
        if not limit or time.monotonic() - self.started < limit:
            return False
        log.warning("skipped %s: --stop-after %g s has passed", what, limit)
        (into if into is not None else self.results.setdefault("skipped", [])).append(
            {"path": what, "skipped": f"--stop-after {limit:g} s passed"})
        self.save()
        return True

    def save(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "served.json").write_text(json.dumps(self.results, indent=2, ensure_ascii=False) + "\n")

    def server_tokens(self) -> int | None:
        """Tokens the server generated since the last call (None without a metrics URL or a first call)."""
        return self.server_counts()[0]

    def server_counts(self) -> tuple[int | None, int | None, int | None]:
        """Tokens generated, decode steps run and microseconds spent stepping by the server since the last call
        (all None without a metrics URL or on a first call)."""
        if not self.settings.metrics_url:
            return None, None, None
        before, self.counter = self.counter, load_stats.settled_counters(self.settings.metrics_url)
        if before is None:
            return None, None, None
        return tuple(now - then for now, then in zip(self.counter, before))


def bench_served(settings: ServedSettings, out: str | Path | None) -> dict:
    """Run every part (see the module docstring); the results as a dict (served.json / served.md under `out`)."""
    if any(protocol == "grpc" for _, protocol in (*settings.paths, *settings.mixed_paths)) and not settings.grpc:
        raise UsageError("gRPC paths need --grpc HOST:PORT (or leave them out of --paths / --mixed-paths)")
    server = http_client.Server.parse(settings.url)
    triton = server.get_json("/v2")
    engine_dir = Path(settings.engine_dir) if settings.engine_dir else engine_dir_of(server)
    tokenizer_dir = tokenizer_dir_of(server)
    run = Run(settings, Path(out) if out is not None else None)
    run.results = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": settings.command(),
                   "machine": {**machine(), **_gpu()},
                   "server": {"url": settings.url, "grpc": settings.grpc, "metrics_url": settings.metrics_url,
                              "triton": triton.get("version"), "engine_dir": str(engine_dir),
                              "tokenizer_dir": tokenizer_dir},
                   "settings": {k: v for k, v in asdict(settings).items() if k != "extra"},
                   **settings.extra}
    log.info("loading %s in this process for the in-process runs", engine_dir)
    started = time.monotonic()
    runtime = InProcess(engine_dir, settings.device, tokenizer_dir)
    run.results["in_process_load_s"] = round(time.monotonic() - started, 2)
    run.results["server"].update(engine=runtime.manifest.engine, dtype=runtime.manifest.dtype,
                                 limits=asdict(runtime.manifest.limits))
    run.save()
    try:
        if settings.repeats > 0 and not run.out_of_time("overhead"):
            run.results["overhead"] = overhead(run, runtime)
            run.save()
        if settings.requests > 0 and not run.out_of_time("fixed workload"):
            workload = fixed_workload(runtime.tokenizer, settings.requests, settings.concurrency,
                                                  settings.prompt_len, settings.new_tokens, settings.seed)
            run.results["fixed"] = {"workload": workload.describe(), "runs": []}
            workload_runs(run, runtime, workload, settings.paths, run.results["fixed"])
        if settings.mixed_requests > 0 and not run.out_of_time("mixed workload"):
            workload = mixed_workload(runtime.tokenizer, settings.mixed_requests,
                                                  settings.mixed_concurrency, settings.mixed_prompts,
                                                  settings.mixed_outputs, settings.seed + 1)
            run.results["mixed"] = {"workload": workload.describe(), "runs": []}
            workload_runs(run, runtime, workload, settings.mixed_paths, run.results["mixed"])
    finally:
        runtime.close()
    if run.out is not None:
        (run.out / "served.md").write_text(markdown(run.results))
        log.info("wrote %s and %s", run.out / "served.json", run.out / "served.md")
    return run.results


def overhead(run: Run, runtime: InProcess) -> dict:
    """`measure_overhead` at --overhead-tokens, replies timed and not compared, with token counts."""
    s = run.settings
    settings = ServingSettings(url=s.url, model=s.overhead_model, prompt=s.overhead_prompt,
                               max_tokens=s.overhead_tokens, concurrency=(), requests=0, repeats=s.repeats,
                               engine_dir=s.engine_dir, device=s.device, timeout=s.timeout, compare_replies=False)
    expected, reply_tokens = runtime.answer(s.overhead_prompt, s.overhead_tokens)
    run.server_tokens()
    result = measure_overhead(settings, runtime, expected)
    served_calls = -(-s.repeats // BLOCK) * (BLOCK + 1)  # the uncounted first call of each block too
    tokens = run.server_tokens()
    local_ms = result["in_process"]["ms"]
    result.update(model=s.overhead_model, prompt=s.overhead_prompt, max_tokens=s.overhead_tokens,
                  in_process_tokens_per_call=reply_tokens,
                  served_tokens_per_call=None if tokens is None else round(tokens / served_calls, 2),
                  overhead_pct={key: _pct(result["overhead_ms"][key], local_ms[key]) for key in ("median", "p90")},
                  target_pct=OVERHEAD_TARGET_PCT)
    result["overhead_pct"]["median_of_block_differences"] = _pct(result["overhead_ms"]["median_of_block_differences"],
                                                                 local_ms["median"])
    result["target_met"] = result["overhead_pct"]["median"] is not None and \
        result["overhead_pct"]["median"] <= OVERHEAD_TARGET_PCT
    return result


def workload_runs(run: Run, runtime: InProcess, workload: Workload,
                  paths: tuple[tuple[str, str], ...], into: dict) -> None:
    """The workload in-process, then through each served path; each row saved as soon as it is measured.

    First, unmeasured, one wave of its first prompts (WARM_UP_TOKENS each) in-process and through the server,
    so that neither side's first prompts of these sizes pay for kernels compiled or tuned on first use."""
    s = run.settings
    end_id = runtime.tokenizer.eos_id
    started = time.monotonic()
    wave = min(workload.concurrency, workload.requests)
    warm = Workload(f"{workload.name} warm-up", workload.texts[:wave], workload.prompt_ids[:wave],
                                tuple(min(n, WARM_UP_TOKENS) for n in workload.max_tokens[:wave]), wave)
    stream_load.run_in_process(runtime.engine.executor, warm, end_id, runtime.stop_words)
    model, protocol = paths[0] if paths else ("ensemble", "http")
    try:
        if protocol == "http":
            stream_load.run_http(s.url, model, warm, s.timeout)
        else:
            stream_load.run_grpc(s.grpc, model, warm, s.timeout)
    except ServerError as e:
        into["warm_up_error"] = str(e)
    run.counter = None  # the warm-up's tokens are not the next run's
    into["warm_up_s"] = _since(started)
    started, before = time.monotonic(), runtime.engine.executor.stats()
    traces, elapsed = stream_load.run_in_process(runtime.engine.executor, workload, end_id, runtime.stop_words,
                                                 timeout=max(s.timeout, 3600.0))
    after = runtime.engine.executor.stats()
    local = {"path": "in-process", **load_stats.stats(workload, traces, elapsed,
                                                       decode_steps=after.decode_calls - before.decode_calls,
                                                       step_us=after.step_us - before.step_us),
             "run_s": _since(started)}
    into["runs"].append(local)
    run.save()
    for model, protocol in paths:
        if run.out_of_time(f"{model} {protocol}", into["runs"]):
            continue
        started = time.monotonic()
        if run.counter is None:
            run.server_tokens()
        try:
            if protocol == "http":
                traces, elapsed = stream_load.run_http(s.url, model, workload, s.timeout)
            else:
                traces, elapsed = stream_load.run_grpc(s.grpc, model, workload, s.timeout)
        except ServerError as e:
            into["runs"].append({"path": f"{model} {protocol}", "model": model, "protocol": protocol,
                                 "error": str(e)})
            run.counter = None
            run.save()
            continue
        row = {"path": f"{model} {protocol}", "model": model, "protocol": protocol,
               **load_stats.stats(workload, traces, elapsed, *run.server_counts())}
        row["run_s"] = _since(started)
        row["vs_in_process_pct"] = {key: _pct(row[key], local[key])
                                    for key in ("tokens_per_s", "requests_per_s")}
        row["target_pct"] = RATIO_TARGET_PCT
        row["target_met"] = (row["vs_in_process_pct"]["tokens_per_s"] or 0) >= RATIO_TARGET_PCT
        into["runs"].append(row)
        run.save()


def _pct(value: float | None, base: float | None) -> float | None:
    """value as % of base."""
    if value is None or not base:
        return None
    return round(100.0 * value / base, 1)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 2)


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": props.name, "gpu_memory_gb": round(props.total_memory / 1e9, 1), "cuda": torch.version.cuda}


# --- the command --------------------------------------------------------------------------------------------


def run(*, url: str, grpc: str | None, metrics_url: str | None, engine_dir: str | None, device: str | None,
        repeats: int, overhead_tokens: int, overhead_prompt: str, overhead_model: str, requests: int, concurrency: int,
        prompt_len: int, new_tokens: int, paths: str, mixed_requests: int, mixed_concurrency: int,
        mixed_prompts: str, mixed_outputs: str, mixed_paths: str, seed: int, timeout: float, stop_after: float,
        out: str | None, extra: dict | None = None, quiet: bool = False) -> dict:
    """Check the flags, run, print the markdown tables (unless quiet)."""
    for name, value in (("repeats", repeats), ("requests", requests), ("mixed-requests", mixed_requests),
                        ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"--{name} must be a whole number ≥ 0, not {value!r}")
    for name, value in (("overhead-tokens", overhead_tokens), ("concurrency", concurrency),
                        ("prompt-len", prompt_len), ("new-tokens", new_tokens),
                        ("mixed-concurrency", mixed_concurrency)):
        check_positive(name, value)
    check_positive("timeout", timeout, float)
    if grpc:
        from trtglm.client.grpc import check_address

        grpc = check_address(str(grpc))
    settings = ServedSettings(url=str(url), grpc=grpc, metrics_url=str(metrics_url) if metrics_url else None,
                        engine_dir=engine_dir, device=device, repeats=repeats, overhead_model=check_model(overhead_model),
                        overhead_prompt=str(overhead_prompt), overhead_tokens=overhead_tokens, requests=requests,
                        concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens,
                        paths=parse_paths(paths), mixed_requests=mixed_requests, mixed_concurrency=mixed_concurrency,
                        mixed_prompts=parse_range(mixed_prompts, "mixed-prompts"),
                        mixed_outputs=parse_range(mixed_outputs, "mixed-outputs"),
                        mixed_paths=parse_paths(mixed_paths), seed=seed, timeout=float(timeout),
                        stop_after=float(stop_after or 0), extra=extra or {})
    results = bench_served(settings, out)
    if not quiet:
        print(markdown(results), end="", flush=True)
    return results
