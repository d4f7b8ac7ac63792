"""`bench tp` (scripts/bench_gpu.sh PARTS=tp) on the CPU: the same processes, comparison and report as on
GPUs, over gloo with the torch ops on the tiny preset's random weights; its comparison on hand-made values;
its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from support.cli_calls import as_command

from trtglm.bench import tp
from trtglm.bench.tp import compare_runs, parse_sizes, step_ratios
from trtglm.cli import bench as cli_bench
from trtglm.errors import DependencyError, UsageError

FP32_TOL = 1e-4


@pytest.mark.slow
def test_tp_runs_compare_with_tp1_and_time_the_steps_and_collectives(tmp_path):
    proc = run_cli("bench", "tp", "--device", "cpu", "--preset", "tiny", "--dtype", "float32", "--tp", "1,2",
                   "--steps", 6, "--batches", "1,3", "--prompt-len", 8, "--new-tokens", 4,
                   "--out", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "tp.json").read_text())
    check = results["against_tp1"]["2"]
    assert check["greedy_ids_equal"] and check["steps"] == 6 and len(check["prompts"]) == 3
    assert check["prefill_max_abs_diff"] <= FP32_TOL and check["decode_max_abs_diff"] <= FP32_TOL
    runs = results["runs"]
    assert runs["2"]["weights_identical_on_ranks"] and runs["1"]["weights_identical_on_ranks"]
    assert [t["batch"] for t in runs["2"]["timings"]] == [1, 3]
    assert all(t["step_ms"] > 0 and t["tokens_per_s"] > 0 for t in runs["2"]["timings"])
    assert runs["1"]["collectives"] == []
    collectives = runs["2"]["collectives"]
    assert [c["batch"] for c in collectives] == [1, 3] and collectives[0]["all_reduces_per_step"] == 2 * 3  # layers
    assert all(c["group_all_reduce_us"] > 0 and c["all_reduce_us"] > 0 for c in collectives)
    assert collectives[0]["one_shot_all_reduce_us"] is None and collectives[0]["one_shot_sums"] is None  # CUDA's
    assert all(c["step_message_us"] > 0 for c in collectives) and ", step message " in proc.stdout
    assert results["step_ratios"]["2"] == pytest.approx(runs["2"]["timings"][0]["step_ms"]
                                                        / runs["1"]["timings"][0]["step_ms"])
    assert "tp 2 vs tp 1: prefill max |Δlogit|" in proc.stdout
    assert "greedy tokens equal over 6 steps for 3 of 3 prompts" in proc.stdout
    assert "batch-1 step" in proc.stdout and "(target ≤ 0.6: " in proc.stdout
    assert "tp 2: model ready" in proc.stdout and ", no one-shot kernel here" in proc.stdout
    assert "one-shot all-reduce of up to" not in proc.stdout and results["one_shot_us"] == {}


def test_the_comparison_finds_where_greedy_tokens_part():
    vocab = 4
    base = {"prefill": torch.tensor([[0.0, 1.0, 3.0, 2.5], [1.0, 0.0, 0.0, 0.0]]),
            "decode": torch.zeros(2, 3, vocab), "ids": torch.tensor([[2, 1, 1, 1], [0, 3, 3, 3]])}
    base["decode"][0, 1] = torch.tensor([0.0, 5.0, 4.75, 0.0])
    split = {"prefill": base["prefill"] + 0.01, "decode": base["decode"].clone(),
             "ids": torch.tensor([[2, 1, 2, 1], [0, 3, 3, 3]])}
    split["decode"][0, 0, 0] = 0.25  # fed the same tokens: counts
    split["decode"][0, 2, 0] = 9.0  # after the tokens parted: does not count
    check = compare_runs(base, split)
    assert check["prefill_max_abs_diff"] == pytest.approx(0.01)
    assert check["decode_max_abs_diff"] == pytest.approx(0.25)
    assert check["prompts"] == [{"first_differing_step": 2, "tp1_margin_there": 0.25},
                                {"first_differing_step": None, "tp1_margin_there": None}]
    assert not check["greedy_ids_equal"] and check["steps"] == 3
    same = compare_runs(base, base)
    assert same["greedy_ids_equal"] and same["decode_max_abs_diff"] == 0.0


def test_step_ratios_are_over_tp1s_batch_1_step():
    runs = {1: {"timings": [{"batch": 1, "step_ms": 4.0}, {"batch": 64, "step_ms": 9.0}]},
            2: {"timings": [{"batch": 1, "step_ms": 2.2}]}, 4: {"timings": [{"batch": 64, "step_ms": 3.0}]}}
    assert step_ratios(runs) == {"2": pytest.approx(0.55)}


def test_bad_options_are_refused(tmp_path):
    assert parse_sizes("1, 2,4", "tp") == (1, 2, 4) and parse_sizes((1, 64), "batches") == (1, 64)
    with pytest.raises(UsageError, match="--tp takes whole numbers"):
        parse_sizes("1,two", "tp")
    with pytest.raises(UsageError, match="--batches takes numbers of at least 1"):
        parse_sizes("0,8", "batches")
    run = as_command(tp.run, cli_bench.tp)
    with pytest.raises(UsageError, match="--max-seq-len 256 is too short"):
        run(tp="1", out=str(tmp_path), device="cpu", max_seq_len=256)
    if not torch.cuda.is_available():
        with pytest.raises(DependencyError, match="bench tp needs a CUDA GPU"):
            run(tp="1,2", out=str(tmp_path))
    proc = run_cli("bench", "tp", "--tp", "1,x", "--device", "cpu", "--out", tmp_path)
    assert proc.returncode == UsageError.exit_code
    assert proc.stderr.strip().splitlines() == ["trtglm: error: --tp takes whole numbers separated by commas, "
                                                "not '1,x'"]
