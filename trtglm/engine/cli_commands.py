"""The `build-engine` and `plan` subcommands as fire functions (flags: --config, --set, ...).

`--set SECTION.KEY=VALUE` may repeat; the CLI hands the pairs over as a list.
"""

from __future__ import annotations

from trtglm.profile import parse_overrides



def build_engine(config: str, model_dir: str | None = None, output_dir: str | None = None, dry_run: bool = False,
                 force: bool = False, target: str = "current", set: str | list | tuple | None = None):
    """YAML profile -> engine folder (engines/NAME): convert if needed, trtllm-build or torch, trtglm.json.

    --target trtllm-0.7 prints TensorRT-LLM v0.7.1's examples/chatglm/build.py command instead.
    --set SECTION.KEY=VALUE overrides profile keys (repeat for several).
    """
    from trtglm.engine.build import build_engine as run

    run(config, model_dir=model_dir, output_dir=output_dir, dry_run=dry_run, force=force, target=target,
        overrides=set_overrides(set))


def plan(config: str, gpu_memory: str = "80GiB", gpus: int | None = None, strict: bool = False,
         set: str | list | tuple | None = None):
    """Memory plan per GPU: weights, KV cache per token, what fits (tokens, max_batch_size, max_num_tokens).

    --gpus N plans for tensor parallelism over N GPUs; --strict exits non-zero when it does not fit.
    """
    from trtglm.engine.plan import plan as run

    run(config, gpu_memory=gpu_memory, gpus=gpus, overrides=set_overrides(set), strict=strict)


def set_overrides(value: str | list | tuple | None) -> dict:
    """`--set` value(s) (KEY=VALUE strings) -> {dotted key: parsed value}."""
    if value is None:
        return {}
    return parse_overrides([value] if isinstance(value, str) else [str(v) for v in value])
