"""`trtglm bench fp8` on the CPU, FP8 emulated (the dry run scripts/bench_gpu.sh's fp8 part is checked by): the fixture
converted with and without --fp8, small loads; what it reports is checked against the checkpoints' own bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from support.cli_calls import convert_checkpoint
from trtglm.bench.fp8 import bench_fp8
from trtglm.cli import main
from trtglm.errors import UsageError

SMALL_LOAD = dict(parts="accuracy,speed", steps=4, requests=4, concurrency=2, prompt_len=8, new_tokens=4,
                  prefill_prompts=2, prefill_len=16, max_num_tokens=64, device="cpu", emulate_fp8=True, fp8_kv_cache=True,
                  tune=False, seed=0, preset="6b", layers=None, prompts=None, calibration_prompts=None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, fixture_dir):
    root = tmp_path_factory.mktemp("bench-fp8")
    return (convert_checkpoint(fixture_dir, root / "bf16", dtype="bfloat16"),
            convert_checkpoint(fixture_dir, root / "fp8", dtype="bfloat16", fp8=True, fp8_kv_cache=True))


def test_bench_fp8_dry_run_reports_both_models(checkpoints, fixture_dir, tmp_path, capsys):
    baseline, fp8 = checkpoints
    results = bench_fp8(baseline_checkpoint=str(baseline), fp8_checkpoint=str(fp8), tokenizer_dir=str(fixture_dir),
                        out=str(tmp_path), **SMALL_LOAD)
    assert json.loads((tmp_path / "fp8.json").read_text()) == json.loads(json.dumps(results))
    accuracy = results["accuracy"]
    assert accuracy["prompts"] == 8 and accuracy["steps"] == 4 and len(accuracy["by_prompt"]) == 8
    assert 0.9 < accuracy["cosine_mean"] <= 1.0 and 0 <= accuracy["greedy_same"] <= 1
    # weights held: every tensor of the checkpoint (FP8's are a byte a value), as the files hold them
    for label, path in (("baseline", baseline), ("fp8", fp8)):
        tensors = load_file(str(path / "rank0.safetensors"))
        kept = sum(t.numel() * t.element_size() for name, t in tensors.items() if "kv_cache_scaling_factor" not in name)
        assert results[label]["weight_bytes"] == kept
        assert results[label]["inflight"]["generated_tokens"] == 4 * 4
        assert results[label]["prefill"]["tokens"] == 2 * 16 and results[label]["decode_step_ms_batch1"] > 0
    assert results["baseline"]["kv_bytes_per_position"] == 2 * results["fp8"]["kv_bytes_per_position"] == \
        2 * 3 * 2 * 16 * 2  # K and V, 3 layers, 2 KV heads, head 16, bfloat16
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bench fp8 on cpu (FP8 emulated)") and any("KV-cache positions per GiB" in line
                                                                          and " 2.00 " in line for line in lines)


def test_bench_fp8_refuses_what_it_cannot_compare(checkpoints, fixture_dir, tmp_path, capsys):
    baseline, fp8 = checkpoints
    flags = {**SMALL_LOAD, "tokenizer_dir": str(fixture_dir), "out": str(tmp_path)}
    with pytest.raises(UsageError, match="must be unquantized and --fp8-checkpoint FP8, not FP8 and None"):
        bench_fp8(**{**flags, "baseline_checkpoint": str(fp8), "fp8_checkpoint": str(baseline)})
    with pytest.raises(UsageError, match="go together"):
        bench_fp8(**{**flags, "baseline_checkpoint": str(baseline), "fp8_checkpoint": None})
    with pytest.raises(UsageError, match="--parts takes accuracy, speed"):
        bench_fp8(**{**flags, "parts": "speed,memory", "baseline_checkpoint": None, "fp8_checkpoint": None})
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["bench", "fp8", "--tokenizer-dir", str(fixture_dir), "--device", "cuda"])
        assert "CUDA is not available" in capsys.readouterr().err
