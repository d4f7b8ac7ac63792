"""Benchmarks, each a `trtglm bench KIND` (trtglm/cli/bench.py): `serving` (serving.py) measures a
launched model repository, `serving-local` (serving_local.py) the tiny fixture's from nothing;
`served` (served.py, its flags' defaults in served_flags.py; workload.py, stream_load.py, load_stats.py,
served_report.py) streams to one next to its engine in-process, and pipeline.py runs it from nothing (model,
engine, repository, timed launches); `runtime` (runtime.py, with measure.py, checks.py, report.py) the fast GPU
runtime; `matmul`, `pdl`, `prefill`, `step-parts` parts of its decode step; `tp` (tp.py) it tensor-parallel
against tp 1; `convert` (convert_speed.py) `trtglm convert` against `cp`."""

DEFAULT_PROMPT = "What is the capital of France?"  # the test fixture's question
# the mixed workload of docs/benchmarks.md: prompt and generated tokens, each uniform in LOW..HIGH (inclusive)
INFLIGHT_PROMPTS = (32, 1024)
INFLIGHT_OUTPUTS = (16, 256)


def range_flag(low_high: tuple[int, int]) -> str:
    """A LOW,HIGH range as a flag takes it: (32, 1024) → "32,1024"."""
    return ",".join(map(str, low_high))
