"""What each kind of small kernel costs a batch-1 decode step of the fast runtime, on the GPU.

For each weight kind, one FastModel on random ChatGLM3-6B-shaped weights (as `bench runtime` makes them) has its
decode graphs captured as they are, then without one kind of kernel at a time, and the step is timed as `bench
runtime` times it (128-token prompt, 127 steps). A removed kernel's output is replaced by one of its inputs, so the
numbers such a step computes are wrong: this is for timing only. The difference to the full step is what that
kind of kernel costs, its wait for the kernel before included.

    trtglm bench step-parts [--kinds int4] [--out results.json]
"""

from __future__ import annotations


import torch

from trtglm.bench.measure import fast_timing, run_kinds
from trtglm.runtime.fast import FastModel, kernels


def without_norm(x, delta, weight, eps):
    return x, x


def without_attention(qkv, slots, positions, cos, sin, k_cache, v_cache, table, num_heads):
    return qkv[:, : num_heads * k_cache.shape[3]]


def without_swiglu(x):
    return x[:, : x.shape[1] // 2]


REMOVED = {"RMSNorm": {"add_rms_norm": without_norm},
           "rotary, KV cache, attention": {"decode_qkv_attention": without_attention},
           "SwiGLU": {"silu_mul": without_swiglu}}
REMOVED["all three"] = {name: fn for parts in REMOVED.values() for name, fn in parts.items()}


def step_ms(model: FastModel, generator: torch.Generator, replaced: dict) -> float:
    """The step with the kernels `replaced` names swapped for their stand-ins, in the model's ops and in the kernels
    module (where the matmuls call silu_mul when they do not apply SwiGLU themselves)."""
    saved = [(owner, name, getattr(owner, name)) for name in replaced for owner in (model.ops, kernels)
             if hasattr(owner, name)]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, replaced[name])
        model.capture_graphs()
        return min(fast_timing(model, 1, 128, 128, generator).decode_ms for _ in range(2))
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def bench_kind(mode: str, ckpt_cfg, tensors: dict, generator: torch.Generator) -> dict:
    model = FastModel(ckpt_cfg, tensors, num_slots=8, max_seq_len=1280, weight_only=mode)
    full = step_ms(model, generator, {})
    costs = {}
    for part, replaced in REMOVED.items():
        costs[part] = full - step_ms(model, generator, replaced)
        print(f"{mode:5} {part:27} {costs[part]:6.3f} ms of a {full:.3f} ms step", flush=True)
    return {"step_ms": full, "cost_ms": costs}


def run(kinds: str, out: str | None) -> None:
    run_kinds(kinds, out, bench_kind)
