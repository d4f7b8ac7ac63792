"""`trtglm bench inflight` (trtglm.bench.inflight): the ideal computed from the measured parts, and both
workloads run end to end on the tiny fixture on the CPU, through the real CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FIXTURE, run_cli
from support.cli_calls import as_command

from trtglm.bench import inflight
from trtglm.bench.inflight import with_ideal
from trtglm.cli import bench as cli_bench
from trtglm.errors import UsageError


def test_the_ideal_is_the_work_at_the_speed_of_its_parts():
    run = {"requests": 4, "concurrency": 2, "generated_tokens": 20, "prompt_tokens": 1000, "seconds": 2.0}
    parts = {"prefill_ms_per_token": 0.5, "decode_step_ms": 10.0}
    ideal = with_ideal(run, parts)
    # 1,000 prompt tokens at 0.5 ms, and 16 tokens after the 4 first ones in full batches of 2: 8 steps of 10 ms
    assert ideal["ideal"]["decode_steps"] == 8
    assert ideal["ideal"]["seconds"] == pytest.approx(0.5 + 0.08)
    assert ideal["ideal"]["tokens_per_s"] == pytest.approx(20 / 0.58)
    assert ideal["pct_of_ideal"] == pytest.approx(29.0)


def test_both_workloads_run_on_the_fixture_through_the_cli(tmp_path):
    proc = run_cli("bench", "inflight", "--fixture", FIXTURE, "--requests", 8, "--concurrency", 4, "--prompts", "8,40",
                   "--outputs", "4,8", "--prefix", 48, "--max-num-tokens", 64, "--tokens-per-block", 16,
                   "--out", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("mixed: ") and "generated tokens/s; ideal" in line and "inter-token p50/p99" in line
               for line in lines)
    assert any(line.startswith("shared 48-token prefix: TTFT p50") and "with reuse off" in line for line in lines)
    results = json.loads((tmp_path / "inflight.json").read_text())
    mixed, off, on = results["mixed"], results["shared_prefix"]["off"], results["shared_prefix"]["on"]
    for run in (mixed, off, on):
        assert run["generated_tokens"] == run["expected_tokens"] > 0 and run["ttft_ms"]["p99"] is not None
    assert mixed["parts"]["prefill_prompt_tokens"] == 40 and mixed["ideal"]["seconds"] > 0
    assert off["prompt_tokens"] == on["prompt_tokens"] == off["computed_prompt_tokens"]  # the same requests
    assert off["reused_prompt_tokens"] == 0 and on["reused_prompt_tokens"] > 0
    assert on["computed_prompt_tokens"] + on["reused_prompt_tokens"] == on["prompt_tokens"]


def test_bad_options_are_refused(tmp_path):
    bench_inflight = as_command(inflight.bench_inflight, cli_bench.inflight)
    with pytest.raises(UsageError, match="--prompts takes LOW,HIGH"):
        bench_inflight(fixture=FIXTURE, prompts="40,8", out=tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="random preset weights run on a GPU"):
            bench_inflight(out=tmp_path)
