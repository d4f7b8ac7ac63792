"""`build-engine` and `plan`: a YAML profile → an engine folder, and its memory plan."""

from __future__ import annotations

from typing import Literal

from trtglm.cli.flags import PosInt


def build_engine(config: str, model_dir: str | None = None, output_dir: str | None = None, dry_run: bool = False,
                 force: bool = False, target: Literal["current", "trtllm-0.7"] = "current", set: list[str] = ()):
    """YAML profile -> engine folder (engines/NAME): convert if needed, trtllm-build or torch, trtglm.json.

    --target trtllm-0.7 prints TensorRT-LLM v0.7.1's examples/chatglm/build.py command instead.
    --set SECTION.KEY=VALUE overrides profile keys (repeat for several).
    """
    from trtglm.engine.build import build_engine as run
    from trtglm.profile import parse_overrides

    run(config, model_dir=model_dir, output_dir=output_dir, dry_run=dry_run, force=force, target=target,
        overrides=parse_overrides(list(set)))


def plan(config: str, gpu_memory: str = "80GiB", gpus: PosInt | None = None, strict: bool = False,
         set: list[str] = ()):
    """Memory plan per GPU: weights, KV cache per token, what fits (tokens, max_batch_size, max_num_tokens).

    --gpus N plans for tensor parallelism over N GPUs; --strict exits non-zero when it does not fit.
    """
    from trtglm.engine.plan import plan as run
    from trtglm.profile import parse_overrides

    run(config, gpu_memory=gpu_memory, gpus=gpus, overrides=parse_overrides(list(set)), strict=strict)
