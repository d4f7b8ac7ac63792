"""Benchmark `trtglm convert` on a ChatGLM3-6B-shaped checkpoint against a plain `cp`.

Generates a random-weight 6B checkpoint once (fp16 safetensors, 7 shards as published;
cached in --work-dir), then converts it at tp 1, at tp 2 and with int8 weight-only (tp 1),
and copies the same shards with `cp`. Each command runs as its own process; its wall time
(also until a following `sync` returns, i.e. with the written data on disk) and peak RSS
(from `wait4`) are recorded; cases are interleaved and repeated, and medians reported.
The page cache is dropped before each run when the machine allows it (root, writable
/proc/sys/vm/drop_caches), so reads come from disk.
Prints a markdown table and writes the results as JSON.

    trtglm bench convert [--work-dir /tmp/trtglm-bench] [--repeats 3] [--json results.json] [--clean]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trtglm.errors import TrtglmError

CASES = {  # name -> extra convert flags (None: the cp baseline)
    "cp (baseline)": None,
    "convert tp1 fp16": ["--tp-size", "1"],
    "convert tp2 fp16": ["--tp-size", "2"],
    "convert tp1 int8 weight-only": ["--tp-size", "1", "--weight-only", "int8"],
}
TARGET_RSS_BYTES = 2 * 1024**3
TARGET_TIME_RATIO = 1.5


def run(work_dir: str, json_path: str | None, repeats: int, clean: bool) -> None:
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "chatglm3-6b-synth"
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
               "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine()}
    if not (model / "config.json").exists():
        results["synth"] = measure([sys.executable, "-m", "trtglm", "synth-model", "--preset", "6b", "--out", model,
                                    "--force"], model)
    source_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    results["source_bytes"] = source_bytes
    results["page_cache_dropped"] = drop_page_cache()
    results["repeats"] = repeats
    samples: dict[str, list[dict]] = {name: [] for name in CASES}
    for repeat in range(repeats):  # interleaved, so a slow spell of the disk hits every case
        for name, flags in CASES.items():
            sample = run_case(model, work / "out", flags)
            samples[name].append(sample)
            print(f"[{repeat + 1}/{repeats}] {name}: {sample['wall_s']:.1f} s "
                  f"({sample['wall_sync_s']:.1f} s with sync), peak RSS {sample['peak_rss_bytes'] / 2**20:.0f} MiB, "
                  f"load {sample['load_average_1min']:.1f}", file=sys.stderr)
    runs = {name: summarize(case_samples) | {"source_bytes": source_bytes} for name, case_samples in samples.items()}
    results["runs"] = runs
    results["targets"] = check_targets(runs)
    print(markdown(results))
    json_path = Path(json_path) if json_path else work / "bench_convert.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nresults: {json_path}", file=sys.stderr)
    if clean:
        shutil.rmtree(work, ignore_errors=True)


def run_case(model: Path, out: Path, flags: list[str] | None) -> dict:
    """One run from a cold page cache into an empty `out` (removed afterwards)."""
    shutil.rmtree(out, ignore_errors=True)
    drop_page_cache()
    if flags is None:
        out.mkdir()
        command = ["cp", *sorted(str(p) for p in model.glob("*.safetensors")), str(out)]
    else:
        command = [sys.executable, "-m", "trtglm", "convert", "--model-dir", model, "--output-dir", out, *flags]
    sample = measure(command, out)
    shutil.rmtree(out, ignore_errors=True)
    return sample


def measure(command: list, out: Path) -> dict:
    """Run `command`: wall time (also until `sync` returns), peak RSS of that process, bytes left in `out`."""
    load = os.getloadavg()[0]  # other work on the machine shows here
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in command], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    subprocess.run(["sync"], check=True)
    wall_sync = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise TrtglmError(f"benchmark command failed: {' '.join(map(str, command))}")
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"command": " ".join(map(str, command)), "wall_s": wall, "wall_sync_s": wall_sync,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "written_bytes": written, "load_average_1min": load,
            "user_s": usage.ru_utime, "sys_s": usage.ru_stime}


def summarize(samples: list[dict]) -> dict:
    """Medians of the times, the largest peak RSS, and every sample."""
    return {"command": samples[0]["command"],
            "wall_s": statistics.median(s["wall_s"] for s in samples),
            "wall_sync_s": statistics.median(s["wall_sync_s"] for s in samples),
            "wall_s_range": [min(s["wall_s"] for s in samples), max(s["wall_s"] for s in samples)],
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s in samples),
            "written_bytes": samples[0]["written_bytes"], "samples": samples}


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_bytes": mem, "python": platform.python_version(),
            "kernel": platform.release()}


def check_targets(runs: dict) -> dict:
    copy = runs["cp (baseline)"]["wall_s"]
    converts = {name: run for name, run in runs.items() if name.startswith("convert")}
    return {
        "peak_rss_max_bytes": max(run["peak_rss_bytes"] for run in converts.values()),
        "peak_rss_ok": all(run["peak_rss_bytes"] <= TARGET_RSS_BYTES for run in converts.values()),
        "time_ratio_max": max(run["wall_s"] / copy for run in converts.values()),
        "time_ok": all(run["wall_s"] <= TARGET_TIME_RATIO * copy for run in converts.values()),
    }


def markdown(results: dict) -> str:
    copy = results["runs"]["cp (baseline)"]["wall_s"]
    lines = ["| run | wall time (median) | range | × cp | with sync | peak RSS | read GB/s | written |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        low, high = run["wall_s_range"]
        lines.append(f"| {name} | {run['wall_s']:.1f} s | {low:.1f}–{high:.1f} s | {run['wall_s'] / copy:.2f} | "
                     f"{run['wall_sync_s']:.1f} s | {run['peak_rss_bytes'] / 2**20:.0f} MiB | "
                     f"{run['source_bytes'] / run['wall_s'] / 1e9:.2f} | {run['written_bytes'] / 1e9:.2f} GB |")
    m = results["machine"]
    lines += ["", f"Source: {results['source_bytes'] / 1e9:.2f} GB in 7 fp16 safetensors shards. "
              f"{results['repeats']} interleaved runs of each case. Page cache dropped before each run: "
              f"{'yes' if results['page_cache_dropped'] else 'no (not permitted)'}.",
              f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_bytes'] / 2**30:.1f} GiB RAM. "
              f"Date: {results['date']}."]
    if "synth" in results:
        s = results["synth"]
        lines.append(f"Generating the checkpoint (synth-model --preset 6b): {s['wall_s']:.0f} s, "
                     f"peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB.")
    return "\n".join(lines)

