"""`trtglm bench runtime` as a fire function (and `bench KIND ...`, which routes to it).

Runnable without the `trtglm` command too (machines without its CLI's dependencies wired):
`python3 -m trtglm.bench.cli_commands runtime --preset 6b ...`.
"""

from __future__ import annotations

import logging
import sys

from trtglm.errors import TrtglmError, UsageError


def runtime(preset: str = "6b", dtype: str = "bf16", weight_only: str | list | tuple = "none",
            batch: str | int | list | tuple = "1,8,32,64", prompt_len: int = 128, new_tokens: int = 128,
            baseline: str = "hf", out: str = "out/bench-runtime", layers: int | None = None, long_prompt: int = 512,
            requests: int = 256, concurrency: int = 64, prefill_chunk: int = 1024, check: bool = True,
            profile: bool = True, tune: bool | None = None, seed: int = 0):
    """The fast GPU runtime against HF generate() and the bandwidth floor, on random 6B-shaped weights.

    --weight-only none|int8|int4 (comma-separated for several), --batch 1,8,32,64: decode batch
    sizes, --prompt-len/--new-tokens: forced lengths (EOS ignored), --baseline hf|none,
    --long-prompt N: TTFT of one N-token prompt, --requests/--concurrency: the in-flight run
    (0 requests skips it), --prefill-chunk N: prompt tokens its executor prefills per step (longer
    prompts go in chunks, between decode steps), --layers N: fewer layers, --no-check / --no-profile
    skip those parts, --no-tune skips timing the matmul kernels' block shapes at start-up (and
    cuBLAS against the one-row kernel for float weights). Writes OUT/runtime.json and
    OUT/runtime.png and prints a table.
    """
    from trtglm.bench.runtime import bench_runtime

    bench_runtime(preset=preset, dtype=dtype, weight_only=weight_only, batch=batch, prompt_len=prompt_len,
                  new_tokens=new_tokens, baseline=baseline, out=out, layers=layers, long_prompt=long_prompt,
                  requests=requests, concurrency=concurrency, prefill_chunk=prefill_chunk, check=check,
                  profile=profile, tune=tune, seed=seed)


def bench(kind: str, **flags):
    """Benchmarks: `bench runtime` (the fast GPU runtime; see `runtime`), `bench served` (trtglm.bench.served)."""
    if kind == "served":
        from trtglm.bench import served_command

        return served_command(**flags)
    if kind != "runtime":
        raise UsageError(f"unknown benchmark {kind!r} (this entry point runs: runtime, served)")
    return runtime(**flags)


def main(argv: list[str] | None = None) -> None:
    import fire

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        fire.Fire(bench, command=list(sys.argv[1:] if argv is None else argv), name="bench")
    except TrtglmError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
