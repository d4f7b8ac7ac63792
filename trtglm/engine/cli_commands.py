"""The `build-engine` and `plan` subcommands as fire functions (flags: --config, --set, ...).

fire keeps only the last of repeated flags, so `--set` also takes several comma-separated
pairs (`--set build.max_batch_size=16,convert.tp_size=2`); `join_repeated_set` turns
repeated `--set` flags into that form before fire sees them.
"""

from __future__ import annotations

import re

from trtglm.profile import parse_overrides

_PAIR_START = re.compile(r",(?=\s*[A-Za-z_]+\.[A-Za-z_]+\s*=)")  # a comma that starts another KEY=


def build_engine(config: str, model_dir: str | None = None, output_dir: str | None = None, dry_run: bool = False,
                 force: bool = False, target: str = "current", set: str | list | tuple | None = None):
    """YAML profile -> engine folder (engines/NAME): convert if needed, trtllm-build or torch, trtglm.json.

    --target trtllm-0.7 prints TensorRT-LLM v0.7.1's examples/chatglm/build.py command instead.
    --set SECTION.KEY=VALUE overrides profile keys (comma-separate several).
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
    """`--set` value(s) -> {dotted key: parsed value}."""
    if value is None:
        return {}
    items = [value] if isinstance(value, str) else [str(v) for v in value]
    pairs = [pair for item in items for pair in _PAIR_START.split(item)]
    return parse_overrides(pairs)


def join_repeated_set(argv: list[str]) -> list[str]:
    """`--set a=1 --set b=2` -> `--set a=1,b=2` (also `--set=a=1`), other arguments unchanged."""
    pairs, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--set" and i + 1 < len(argv):
            pairs.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--set="):
            pairs.append(arg[len("--set="):])
        else:
            rest.append(arg)
        i += 1
    return rest + (["--set", ",".join(pairs)] if pairs else [])
