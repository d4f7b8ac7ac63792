"""The served benchmark's results (served.json, served.py) as markdown: the pipeline's steps and
launches, Triton's overhead over the in-process call, and one table per workload with each path's
tokens/s, TTFT and inter-token times next to the in-process run."""

from __future__ import annotations

from trtglm.bench.serving import BLOCK

RATIO_TARGET_PCT = 90.0  # served generated tokens/s over in-process, at least


def _num(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def markdown(results: dict) -> str:
    """The results as tables: launches (when the pipeline measured them), overhead, each workload."""
    m, server = results.get("machine", {}), results.get("server", {})
    lines = [f"Measured {results.get('date')} on {m.get('gpu') or 'CPU'} ({m.get('nproc')} CPU cores, "
             f"{m.get('cpu')}), Python {m.get('python')}, torch {m.get('torch')}, Triton {server.get('triton')}; "
             f"{server.get('engine')} engine, {server.get('dtype')}, limits {server.get('limits')}.", "",
             "```", results.get("command", ""), "```"]
    if results.get("steps"):
        lines += ["", "| step | s |", "|---|---:|"]
        lines += [f"| {name} | {_num(seconds)} |" for name, seconds in results["steps"].items()]
    for launch in results.get("launches", []):
        lines += ["", launch_markdown(launch)]
    if "in_process_load_s" in results:
        lines += ["", f"In-process engine load (this process, for the comparisons): {results['in_process_load_s']} s."]
    o = results.get("overhead")
    if o:
        lines += ["", f"**Overhead**, one request at a time, {o['max_tokens']} new tokens, HTTP `generate` through "
                      f"`{o['model']}` ({o['calls']} calls each, alternating blocks of {BLOCK}; tokens per "
                      f"call: in-process {o['in_process_tokens_per_call']}, served "
                      f"{_num(o['served_tokens_per_call'], 2)}):", "",
                  "| path | median ms | p90 ms |", "|---|---:|---:|",
                  f"| served (`{o['model']}`) | {o['served']['ms']['median']} | {o['served']['ms']['p90']} |",
                  f"| in-process | {o['in_process']['ms']['median']} | {o['in_process']['ms']['p90']} |",
                  f"| **Triton overhead** | **{o['overhead_ms']['median']}** "
                  f"({_num(o['overhead_pct']['median'])}%) | **{o['overhead_ms']['p90']}** "
                  f"({_num(o['overhead_pct']['p90'])}%) |", "",
                  f"Median of the block differences: {o['overhead_ms']['median_of_block_differences']} ms "
                  f"({_num(o['overhead_pct']['median_of_block_differences'])}%). Target ≤ {o['target_pct']:g}% "
                  f"(median): {'met' if o['target_met'] else '**missed**'}."]
    for key, title in (("fixed", "Fixed workload"), ("mixed", "Mixed workload")):
        part = results.get(key)
        if part:
            lines += ["", workload_markdown(title, part)]
    return "\n".join(lines) + "\n"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}%"


def workload_markdown(title: str, part: dict) -> str:
    w = part["workload"]
    lines = [f"**{title}** ({w['name']}): {w['requests']} streamed requests, {w['concurrency']} in flight; prompts "
             f"{w['prompt_tokens']['min']}–{w['prompt_tokens']['max']} ids ({w['prompt_tokens']['total']:,} in all, "
             f"chat template included), max_tokens {w['max_tokens']['min']}–{w['max_tokens']['max']} "
             f"({w['max_tokens']['total']:,} in all):", "",
             "| path | requests (failed) | generated tokens (short requests) | tokens/s | requests/s "
             "| TTFT p50 / p99 ms | inter-token p50 / p99 ms | ms per decode step | engine busy | tokens/s vs in-process |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|"]
    for row in part["runs"]:
        if "requests" not in row:
            lines.append(f"| {row['path']} | {row.get('error') or row.get('skipped')} | | | | | | | | |")
            continue
        counted = _num(row["generated_tokens"])
        if row.get("server_tokens") is not None and row["client_tokens"] != row["server_tokens"]:
            counted += f" (client saw {row['client_tokens']:,})"
        ratio = row.get("vs_in_process_pct", {}).get("tokens_per_s")
        verdict = "" if ratio is None else f" ({'met' if row.get('target_met') else '**missed**'})"
        lines.append(f"| {row['path']} | {row['requests']} ({row['failed']}) | {counted} ({_num(row['short_requests'])}) "
                     f"| {_num(row['tokens_per_s'])} | {_num(row['requests_per_s'], 2)} "
                     f"| {_num(row['ttft_ms']['p50'])} / {_num(row['ttft_ms']['p99'])} "
                     f"| {_num(row['itl_ms']['p50'], 2)} / {_num(row['itl_ms']['p99'], 2)} "
                     f"| {_num(row.get('ms_per_decode_step'), 2)} | {_percent(row.get('engine_busy_pct'))} "
                     f"| {'–' if ratio is None else f'{ratio:.1f}%'}{verdict} |")
    errors = sorted({e for row in part["runs"] for e in row.get("errors", [])})
    if errors:
        lines += ["", "Errors: " + "; ".join(errors[:5])]
    lines += ["", f"Target: served tokens/s ≥ {RATIO_TARGET_PCT:g}% of in-process. Generated tokens: the server's "
                  "counter where the metrics endpoint was given (tensorrt_llm_bls events merge tokens whose text "
                  "is held back); short requests stopped before max_tokens (end id or a stop word). Inter-token times are "
                  "per token: tokens that arrive together in one response (merged while the previous one was being "
                  "sent) are 0 ms apart. ms per decode step: the run's time over the engine's decode steps; engine busy: "
                  "the share of the run the engine spent in its steps (the rest it waited for requests)."]
    return "\n".join(lines)


def launch_markdown(launch: dict) -> str:
    lines = [f"**Launch to ready, {launch['label']}** (`trtglm launch --detach` returned after "
             f"{_num(launch.get('launch_s'), 2)} s, exit {launch.get('returncode')}; /v2/health/ready first answered "
             f"after {_num(launch.get('ready_s'), 2)} s):", "", "| phase | s |", "|---|---:|"]
    lines += [f"| {phase} | {_num(seconds, 2)} |" for phase, seconds in launch.get("phases", {}).items()]
    if launch.get("logged"):
        lines += ["", "Logged by the tensorrt_llm model: " + "; ".join(launch["logged"]) + "."]
    return "\n".join(lines)
