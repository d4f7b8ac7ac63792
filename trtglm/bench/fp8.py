"""`trtglm bench fp8`: an FP8 checkpoint against the same model unquantized, for accuracy and speed, in one process.

The two models:
- `--preset 6b` (default): random ChatGLM3-6B-shaped weights made on the GPU (as `bench runtime` makes them), as a
  bfloat16 checkpoint and as an FP8 one with an FP8 KV cache, both in memory, the FP8 one made by the converter's own
  calibration (its default prompts, or --calibration-prompts) and quantization (convert/fp8.py);
- `--baseline-checkpoint DIR --fp8-checkpoint DIR`: two tp-1 checkpoints `trtglm convert` wrote from one model (e.g.
  a real ChatGLM3-6B, with and without --fp8).

Accuracy (fp8_parts.py) on real prompts: bench/fp8_prompts.txt (held out from the calibration prompts) or --prompts,
in the chat format, encoded by --tokenizer-dir's tokenizer. Speed on one GPU, both models built alike (the same batch,
sequence and KV-cache limits, CUDA graphs, tuned matmuls for the unquantized one). FP8 needs FP8 tensor cores; on a
CPU `--emulate-fp8` runs the FP8 arithmetic in float32 instead (a stand-in: a dry run of the benchmark whose timings
mean nothing).

Writes OUT/fp8.json and prints a table: each figure of both models, FP8's over the baseline's, and the target.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from trtglm.bench.fp8_parts import Load, accuracy_summary, compare, sequences_and_logits, speed
from trtglm.chatglm.prompt_file import read_prompt_ids
from trtglm.conventions import FP8
from trtglm.errors import UsageError

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = Path(__file__).with_name("fp8_prompts.txt")
PARTS = ("accuracy", "speed")
# (figure, where in a model's speed results, whether more is better, FP8's target over the baseline)
TARGETS = (("in-flight generated tokens/s", ("inflight", "tokens_per_s"), True, 1.5),
           ("decode step at batch 1, ms", ("decode_step_ms_batch1",), False, 0.6),
           ("prefill tokens/s", ("prefill", "tokens_per_s"), True, 1.6),
           ("weights held, GB", ("weight_bytes",), False, 0.55),
           ("KV-cache positions per GiB", ("kv_positions_per_gib",), True, 2.0),
           ("KV-cache positions beside the weights", ("kv_positions_beside_weights",), True, None))
MIN_COSINE = 0.99


def bench_fp8(*, preset: str, layers: int | None, baseline_checkpoint: str | None, fp8_checkpoint: str | None,
              tokenizer_dir: str | None, prompts: str | None, calibration_prompts: str | None, parts: str, steps: int,
              requests: int, concurrency: int, prompt_len: int, new_tokens: int, prefill_prompts: int,
              prefill_len: int, max_num_tokens: int, device: str, emulate_fp8: bool, fp8_kv_cache: bool, tune: bool,
              seed: int, out: str) -> dict:
    chosen = _parts(parts)
    if tokenizer_dir is None:
        raise UsageError("--tokenizer-dir is needed: the prompts are real text, encoded by the model's tokenizer")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but CUDA is not available (a dry run on the CPU: --device cpu --emulate-fp8)")
    eval_ids = read_prompt_ids(prompts or DEFAULT_PROMPTS, tokenizer_dir, "--prompts")
    load = Load(steps, requests, concurrency, prompt_len, new_tokens, prefill_prompts, prefill_len, max_num_tokens)
    torch.manual_seed(seed)
    models, name = _checkpoints(preset, layers, baseline_checkpoint, fp8_checkpoint, tokenizer_dir,
                                calibration_prompts, fp8_kv_cache, device, seed)
    _check_vocabulary(eval_ids, models[0][0].vocab_size)
    limits = _limits(load, eval_ids, chosen, models[0][0].max_position_embeddings)
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": name,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (FP8 emulated)",
               "load": asdict(load), "limits": limits, "parts": list(chosen), "baseline": {}, "fp8": {}}
    baseline_logits = None
    for label, (cfg, tensors) in zip(("baseline", "fp8"), models):
        start = time.perf_counter()
        model = _fast_model(cfg, tensors, limits, device, emulate_fp8, tune)
        entry = results[label]
        entry.update({"dtype": cfg.dtype, "quant_algo": cfg.quant_algo, "kv_cache_quant_algo": cfg.kv_cache_quant_algo,
                      "setup_s": time.perf_counter() - start})
        generator = torch.Generator(device=device).manual_seed(seed)
        if "accuracy" in chosen and label == "baseline":
            baseline_logits = sequences_and_logits(model, eval_ids, steps)
        if "accuracy" in chosen and label == "fp8":
            results["accuracy"] = accuracy_summary(compare(model, eval_ids, baseline_logits, steps), steps)
        if "speed" in chosen:
            entry.update(speed(model, load, generator))
        del model
        _free(device)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp8.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print("\n".join(summary(results)), flush=True)
    return results


def _parts(parts: str) -> tuple[str, ...]:
    chosen = tuple(p for p in parts.replace(" ", "").split(",") if p)
    if not chosen or any(p not in PARTS for p in chosen):
        raise UsageError(f"--parts takes {', '.join(PARTS)} (comma-separated), not {parts!r}")
    return chosen


def _check_vocabulary(prompts: list[list[int]], vocab: int) -> None:
    largest = max(max(p) for p in prompts)
    if largest >= vocab:
        raise UsageError(f"the tokenizer gives id {largest}, past the model's {vocab} embedding rows: give "
                         "--tokenizer-dir the model's own tokenizer")


def _limits(load: Load, prompts: list[list[int]], parts: tuple[str, ...], positions: int) -> dict:
    """Batch, sequence and KV-cache limits that hold every part's sequences (the same for both models)."""
    block = 64
    longest = max(map(len, prompts)) + load.steps + 1 if "accuracy" in parts else 0
    served = load.prompt_len + load.new_tokens + 1 if "speed" in parts else 0
    prefill = load.prefill_len + 1 if "speed" in parts else 0
    max_seq_len = min(positions, -(-max(longest, served, prefill) // block) * block)
    held = max(len(prompts) * (longest + block), load.concurrency * (served + block),
               load.prefill_prompts * (prefill + block), max_seq_len)
    return {"num_slots": max(len(prompts), load.concurrency, load.prefill_prompts), "max_seq_len": max_seq_len,
            "kv_tokens": -(-held // block) * block, "block_size": block}


def _fast_model(cfg, tensors: dict, limits: dict, device: torch.device, emulate_fp8: bool, tune: bool):
    from trtglm.runtime.fast import FastModel

    return FastModel(cfg, tensors, device=device, emulate_fp8=emulate_fp8 and cfg.quant_algo == FP8,
                     tune=None if tune else False, **limits)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the two checkpoints --------------------------------------------------------------------------------------------

def _checkpoints(preset: str, layers: int | None, baseline: str | None, fp8: str | None, tokenizer_dir: str,
                 calibration_prompts: str | None, kv_cache: bool, device: torch.device, seed: int) -> tuple[list, str]:
    """([(CheckpointConfig, rank-0 tensors) of the baseline, of the FP8 checkpoint], the models' name)."""
    if (baseline is None) != (fp8 is None):
        raise UsageError("--baseline-checkpoint and --fp8-checkpoint go together (or neither: random --preset weights)")
    if baseline is not None:
        return _converted(Path(baseline), Path(fp8)), f"{Path(baseline).name} and {Path(fp8).name}"
    return _random(preset, layers, tokenizer_dir, calibration_prompts, kv_cache, device, seed), \
        f"random {preset}{f' ({layers} layers)' if layers else ''} bfloat16 weights"


def _converted(baseline: Path, fp8: Path) -> list:
    from trtglm.runtime.checkpoint import load_checkpoint

    pair = [load_checkpoint(baseline), load_checkpoint(fp8)]
    (plain, quantized) = (ckpt.config for ckpt in pair)
    if plain.tp_size != 1 or quantized.tp_size != 1:
        raise UsageError("bench fp8 runs tp-1 checkpoints (convert --tp-size 1)")
    if plain.quant_algo is not None or quantized.quant_algo != FP8:
        raise UsageError(f"--baseline-checkpoint must be unquantized and --fp8-checkpoint FP8, not "
                         f"{plain.quant_algo} and {quantized.quant_algo}")
    shape = ("num_layers", "hidden_size", "intermediate_size", "vocab_size", "num_heads", "num_kv_heads")
    if any(getattr(plain, key) != getattr(quantized, key) for key in shape):
        raise UsageError(f"{baseline} and {fp8} are not checkpoints of one model")
    return [(ckpt.config, ckpt.ranks[0]) for ckpt in pair]


def _random(preset: str, layers: int | None, tokenizer_dir: str, calibration_prompts: str | None, kv_cache: bool,
            device: torch.device, seed: int) -> list:
    """bfloat16 random weights and their FP8 checkpoint (with an FP8 KV cache when `kv_cache`), calibrated as
    `convert --fp8` calibrates."""
    from trtglm.bench.measure import checkpoint_tensors, synth_tensors
    from trtglm.convert.fp8 import calibrated_scales, calibration_prompt_ids, fp8_rank_tensors
    from trtglm.convert.writer import trtllm_config
    from trtglm.runtime.checkpoint import CheckpointConfig

    hf_cfg, hf_tensors = synth_tensors(preset, layers, "bfloat16", seed, device)
    cfg, tensors = checkpoint_tensors(hf_cfg, hf_tensors, "bfloat16")
    del hf_tensors
    prompts = calibration_prompt_ids(calibration_prompts, tokenizer_dir, hf_cfg.version)
    _check_vocabulary(prompts, cfg.vocab_size)
    start = time.perf_counter()
    scales = calibrated_scales(cfg, tensors.__getitem__, prompts, kv_cache, device)
    log.info("calibrated in %.1f s", time.perf_counter() - start)
    fp8_cfg = CheckpointConfig.from_dict(trtllm_config(hf_cfg, "bfloat16", 1, 1, FP8, FP8 if kv_cache else None))
    return [(cfg, tensors), (fp8_cfg, fp8_rank_tensors(tensors, scales))]


# --- the report -----------------------------------------------------------------------------------------------------

def _figure(entry: dict, path: tuple[str, ...]):
    for key in path:
        entry = entry.get(key) if isinstance(entry, dict) else None
    return entry


def summary(results: dict) -> list[str]:
    lines = [f"bench fp8 on {results['device']}: {results['model']}, baseline {results['baseline'].get('dtype')} "
             f"against FP8 (KV cache {results['fp8'].get('kv_cache_quant_algo') or 'unquantized'})"]
    accuracy = results.get("accuracy")
    if accuracy:
        verdict = "meets" if accuracy["worst_prompt_cosine_mean"] >= MIN_COSINE else "MISSES"
        lines += [f"accuracy over {accuracy['prompts']} prompts ({accuracy['positions']} positions, teacher-forced on "
                  f"the baseline's greedy continuations): logits cosine mean {accuracy['cosine_mean']:.4f}, worst "
                  f"prompt {accuracy['worst_prompt_cosine_mean']:.4f}, worst position {accuracy['cosine_min']:.4f} "
                  f"({verdict} ≥ {MIN_COSINE}); top-1 {accuracy['top1']:.1%}",
                  f"greedy over {accuracy['steps']} steps: leading tokens the same (median over prompts) "
                  f"{accuracy['greedy_same_prefix_median']:g}, all tokens the same {accuracy['greedy_same']:.1%}"]
    if "speed" in results["parts"]:
        lines.append(f"{'':40} {'baseline':>12} {'FP8':>12} {'FP8/base':>9} {'target':>8}")
        for label, path, more_is_better, target in TARGETS:
            base, fp8 = _figure(results["baseline"], path), _figure(results["fp8"], path)
            if base is None or fp8 is None:
                continue
            scale = 1e-9 if label.startswith("weights") else 1
            ratio = fp8 / base if base else float("nan")
            goal = "" if target is None else f"{'≥' if more_is_better else '≤'} {target:g}"
            lines.append(f"{label:40} {base * scale:12,.2f} {fp8 * scale:12,.2f} {ratio:9.2f} {goal:>8}")
    return lines
