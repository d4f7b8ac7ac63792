"""`build-engine` and `plan`: a YAML profile → an engine folder, and its memory plan."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from trtglm.cli.flags import PosInt
from trtglm.conventions import FP8
from trtglm.errors import UsageError


def build_engine(config: str, model_dir: str | None = None, output_dir: str | None = None, dry_run: bool = False,
                 force: bool = False, target: Literal["current", "trtllm-0.7"] = "current", set: list[str] = ()):
    """YAML profile -> engine folder (engines/NAME): convert if needed, trtllm-build or torch, trtglm.json.

    --target trtllm-0.7 prints TensorRT-LLM v0.7.1's examples/chatglm/build.py command instead.
    --set SECTION.KEY=VALUE overrides profile keys (repeat for several).
    """
    from trtglm.engine.build import build_engine as run
    from trtglm.profile import parse_overrides

    built = run(config, model_dir=model_dir, output_dir=output_dir, dry_run=dry_run, force=force, target=target,
                overrides=parse_overrides(list(set)))
    if built is not None and warmup_applies(built):
        warmup(str(built))


def warmup(engine_dir: str):
    """Compile and tune the engine's GPU kernels on this GPU and keep them with the engine (ENGINE/kernels/),
    so that a launch on a GPU like this one starts without compiling (build-engine does it on a GPU).
    """
    import torch

    from trtglm.backend.engine import ServedEngine, engine_info

    info = engine_info(engine_dir)
    if not torch.cuda.is_available():
        raise UsageError("warmup compiles and tunes GPU kernels: this machine has no CUDA GPU (on a CPU, trtglm's "
                         "runtime compiles nothing)")
    if info.world_size != 1:
        raise UsageError(f"{engine_dir}: warmup runs one GPU (tp 1); an engine of tp × pp {info.world_size} keeps its "
                         "kernels at its first launch")
    started = time.monotonic()
    print(f"warming up {engine_dir} on this GPU: weights, kernels (compiling and tuning: minutes), CUDA graphs",
          flush=True)
    ServedEngine(engine_dir).close()
    print(f"kernels ready in {Path(engine_dir) / 'kernels'} ({time.monotonic() - started:.0f} s)", flush=True)


def warmup_applies(engine_dir: Path) -> bool:
    """Whether build-engine warms the engine up: a one-GPU engine for trtglm's runtime, on a machine with a GPU."""
    import torch

    from trtglm.engine.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    one_gpu = manifest.mapping.world_size == 1
    if manifest.engine != "torch" or not torch.cuda.is_available() or os.environ.get("TRTGLM_DEVICE") == "cpu":
        return False
    if not one_gpu:
        print(f"{engine_dir}: tp > 1: its kernels are compiled and kept at its first launch", flush=True)
    quantization = manifest.quantization
    if one_gpu and FP8 in (quantization.get("quant_algo"), quantization.get("kv_cache_quant_algo")):
        from trtglm.runtime.fast.linear import fp8_problem

        problem = fp8_problem(torch.device("cuda", torch.cuda.current_device()))
        if problem:  # the engine is whole; it runs (and compiles its kernels) on an Ada or Hopper GPU
            print(f"{engine_dir}: not warmed up: an FP8 engine, and {problem}", flush=True)
            return False
    return one_gpu


def plan(config: str, gpu_memory: str = "80GiB", gpus: PosInt | None = None, strict: bool = False,
         set: list[str] = ()):
    """Memory plan per GPU: weights, KV cache per token, what fits (tokens, max_batch_size, max_num_tokens).

    --gpus N plans for tensor parallelism over N GPUs; --strict exits non-zero when it does not fit.
    """
    from trtglm.engine.plan import plan as run
    from trtglm.profile import parse_overrides

    run(config, gpu_memory=gpu_memory, gpus=gpus, overrides=parse_overrides(list(set)), strict=strict)
