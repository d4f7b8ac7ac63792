"""`bench runtime`'s report: the targets met or missed, the summary table and the tokens/s plot."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The runtime's targets. Millisecond limits are an H200's; on another GPU they are the same fractions of the floor,
# i.e. scaled by the H200's copy bandwidth (docs/benchmarks.md: 4,286 GB/s) over the one measured in the run.
H200_COPY_GBS = 4286.0
DECODE_MS_TARGETS = {"int8": 2.2, "int4": 1.4}  # batch-1 decode step on an H200
FLOOR_RATIO_TARGET = 1.25  # the dtype's batch-1 decode step over its floor, at most
SPEEDUP_TARGET = (64, 10.0)  # at this batch, tokens/s over HF's, at least
LONG_TTFT_TARGET_MS = 30.0  # one long prompt (--long-prompt), at most


# --- reporting ---------------------------------------------------------------------------------------------------

def fill_ratios(results: dict) -> None:
    hf = {row["batch"]: row for row in results["hf"]}
    for entry in results["trtglm"].values():
        for row in entry["runs"]:
            row["pct_of_floor"] = 100 * row["floor_ms"] / row["decode_ms"]
            if row["batch"] in hf:
                row["speedup_vs_hf"] = row["tokens_per_s"] / hf[row["batch"]]["tokens_per_s"]


def targets(results: dict) -> list[dict]:
    """Each target the run has the figures for: its limit, this run's value and whether it is met."""
    runs = {(mode, row["batch"]): row for mode, entry in results["trtglm"].items() for row in entry["runs"]}
    h200 = "H200" in results["device"]["name"]
    scale = 1.0 if h200 else H200_COPY_GBS / results["copy_bandwidth_gbs"]
    rows = []

    def name(mode: str) -> str:
        return results["options"]["dtype"] if mode == "none" else mode

    def add(target: str, value: float | None, limit: float, unit: str, at_most: bool = True) -> None:
        if value is not None:
            rows.append({"target": target, "limit": limit, "at_most": at_most, "value": value, "unit": unit,
                         "met": value <= limit if at_most else value >= limit})

    if ("none", 1) in runs:
        row = runs["none", 1]
        add(f"{name('none')} batch 1 step / floor", row["decode_ms"] / row["floor_ms"], FLOOR_RATIO_TARGET, "×")
    batch, speedup = SPEEDUP_TARGET
    for mode in results["trtglm"]:
        if (mode, batch) in runs:
            add(f"{name(mode)} batch {batch} tokens/s over HF's", runs[mode, batch]["speedup_vs_hf"], speedup, "×",
                at_most=False)
    for mode, h200_ms in DECODE_MS_TARGETS.items():
        if (mode, 1) in runs:
            where = "" if h200 else f" (H200's {h200_ms} ms × {scale:.2f}, the bandwidth ratio)"
            add(f"{mode} batch 1 step{where}", runs[mode, 1]["decode_ms"], h200_ms * scale, "ms")
    for mode, entry in results["trtglm"].items():
        long = entry.get("ttft_long_ms")
        if long:
            add(f"{name(mode)} TTFT of a {long['prompt_len']}-token prompt", long["ms"], LONG_TTFT_TARGET_MS, "ms")
    return rows


def _target_line(t: dict) -> str:
    verdict = "met" if t["met"] else f"**missed by {abs(t['value'] / t['limit'] - 1):.1%}**"
    return (f"| {t['target']} | {'≤' if t['at_most'] else '≥'} {t['limit']:.3g} {t['unit']} | {t['value']:.3f} "
            f"{t['unit']} | {verdict} |")


def summary(results: dict) -> str:
    """Markdown tables of the results (printed, and pasted into docs/benchmarks.md)."""
    header = (f"device: {results['device']['name']}; copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s; "
              f"{results['model']['parameters'] / 1e9:.2f} B parameters, {results['model']['layers']} layers")
    lines = [header, "",
             "| system | batch | TTFT ms | ms/step | floor ms | % of floor | tokens/s | × HF |",
             "|---|---|---|---|---|---|---|---|"]
    rows = list(results["hf"]) + [row for entry in results["trtglm"].values() for row in entry["runs"]]
    for r in rows:
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] else "–"
        pct = f"{r['pct_of_floor']:.0f}%" if r["pct_of_floor"] else "–"
        speedup = f"{r['speedup_vs_hf']:.1f}" if r["speedup_vs_hf"] else "–"
        lines.append(f"| {r['system']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_ms']:.3f} | {floor} | {pct} "
                     f"| {r['tokens_per_s']:.0f} | {speedup} |")
    for mode, entry in results["trtglm"].items():
        lines.append("")
        lines.append(f"{mode}: {entry['weight_gb']:.2f} GB weights/step; TTFT {entry['ttft_long_ms']['prompt_len']} "
                     f"tokens {entry['ttft_long_ms']['ms']:.1f} ms")
        for name, check in entry.get("check", {}).items():
            lines.append(f"  {name}: {_check_line(check)}")
        for batch, p in entry.get("profile", {}).items():
            lines.append(f"  eager decode step, batch {batch}: {p['kernels']} kernels, {p['kernel_ms']:.3f} ms of "
                         "kernel time")
            lines.extend(f"    {t['ms']:.3f} ms  {t['calls']:4d}×  {t['name']}" for t in p["top"][:6])
        if "inflight" in entry:
            f = entry["inflight"]
            lines.append(f"  in-flight: {f['requests']} requests at concurrency {f['concurrency']}: "
                         f"{f['requests_per_s']:.2f} req/s, {f['tokens_per_s']:.0f} tokens/s, TTFT p50/p99 "
                         f"{f['ttft_ms']['p50']:.0f}/{f['ttft_ms']['p99']:.0f} ms, ITL p50/p99 "
                         f"{f['itl_ms']['p50']:.1f}/{f['itl_ms']['p99']:.1f} ms")
            if "ideal" in f:
                lines.append(f"    ideal from its parts {f['ideal']['tokens_per_s']:.0f} tokens/s: "
                             f"{f['pct_of_ideal']:.0f}% of it")
    if results.get("targets"):
        lines += ["", "| target | limit | this run | |", "|---|---|---|---|"]
        lines.extend(_target_line(t) for t in results["targets"])
    if "hf_bf16_vs_fp32" in results:
        lines.append(f"HF in the benchmark dtype vs HF fp32: {_check_line(results['hf_bf16_vs_fp32'])}")
    for mode, checks in (results.get("fixture_check") or {}).items():
        if mode == "hf_vs_fp32":
            lines.append(f"trained fixture, HF vs HF fp32: {_check_line(checks)}")
        else:
            lines.extend(f"trained fixture, {mode} {name}: {_check_line(c)}" for name, c in checks.items()
                         if name.startswith("decode"))
    if results.get("errors"):
        lines.append("")
        lines.extend(f"FAILED {key}: {error}" for key, error in results["errors"].items())
    if "kernel_checks" in results:
        lines.append("")
        lines.append("kernel checks (relative error): " + ", ".join(
            f"{k} {v:.1e}" for k, v in results["kernel_checks"].items()))
    return "\n".join(lines)


def _check_line(check: dict) -> str:
    decisive = "–" if check["top1_decisive"] is None else f"{check['top1_decisive']:.4f}"
    return (f"top-1 {check['top1']:.4f} (where decisive: {decisive} of {check['decisive_share']:.0%}), "
            f"max |Δ| {check['max_abs_diff']:.3f} of max |ref| {check['ref_max_abs']:.2f}, rel {check['rel_error']:.1e}")


def plot(results: dict, path: Path) -> None:
    """Generated tokens/s against batch size: each system, and the bf16 decode floor."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series = {"HF generate()": results["hf"]}
    series.update({f"trtglm {mode}": entry["runs"] for mode, entry in results["trtglm"].items()})
    for label, rows in series.items():
        if rows:
            ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=label)
    for mode, entry in results["trtglm"].items():
        rows = entry["runs"]
        ax.plot([r["batch"] for r in rows], [r["batch"] / r["floor_ms"] * 1e3 for r in rows], linestyle="--",
                linewidth=1, label=f"floor ({mode} weights)")
    opts = results["options"]
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="generated tokens/s",
           title=f"ChatGLM3-6B shapes, {opts['dtype']}, {opts['prompt_len']}+{opts['new_tokens']} tokens, "
                 f"{results['device']['name']}")
    ax.set_xticks(opts["batch"], [str(b) for b in opts["batch"]])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
