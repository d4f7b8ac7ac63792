"""The one-row (batch-1 decode) matmuls of the fast runtime on ChatGLM3-6B's four weight shapes, on the GPU.

For each weight kind (bf16, int8, int4), shape and candidate block shape: the kernel's median time (replayed
from a CUDA graph with the L2 cache overwritten before each call, as in a decode step), the bytes it reads per
second and as a share of the device-to-device copy bandwidth measured in the same run, and its relative error
against float32 products with the dequantized weights. int8/int4 run the Gluon kernels (gluon_gemv.py: the one-row
kernel and the tensor-core one); with --portable they are also timed with the plain-Triton one-row kernel on the same
planar words, for comparison.

    trtglm bench matmul [--portable] [--out results.json]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trtglm.bench.measure import copy_bandwidth
from trtglm.runtime.fast import kernels
from trtglm.runtime.fast.linear import Linear
from trtglm.runtime.quant import fake_quantize

SHAPES = {"qkv": (4608, 4096, False), "dense": (4096, 4096, False), "fc": (27392, 4096, False),
          "proj_swiglu": (4096, 13696, True)}  # name: (N, K, input is [up; gate] to SwiGLU)
ALGOS = {"bf16": None, "int8": "W8A16", "int4": "W4A16"}


def time_us(fn) -> float:
    return 1000 * kernels.graph_time_ms(fn, calls=20, replays=9)


def bench_shape(name: str, algo: str | None, bandwidth: float, portable: bool, g: torch.Generator, m: int = 1
                ) -> list[dict]:
    n, k, swiglu = SHAPES[name]
    weight = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    layer = Linear.from_weight(weight, None, algo, torch.bfloat16, use_triton=True)
    x = torch.randn(m, 2 * k if swiglu else k, device="cuda", generator=g, dtype=torch.bfloat16)
    inputs = kernels.silu_mul(x) if swiglu else x
    exact = fake_quantize(weight, algo) if algo else weight.float()
    expected = inputs.float() @ exact.T
    rows = []
    variants = [("gluon" if layer.kind else "portable", True)]
    if portable and layer.kind and m == 1:
        variants.append(("portable", False))
    for kernel, gluon in variants:
        configs = kernels.candidates(layer.kind, kernels.row_bucket(m), gluon)
        available = kernels.gluon_available
        kernels.gluon_available = available if gluon else (lambda x: False)
        try:
            for config in configs + ([kernels.CUBLAS] if layer.kind == kernels.FLOAT else []):
                def run(config=config):
                    return kernels.matmul(x, layer.stored, layer.scale, None, layer.kind, swiglu, config)
                try:
                    got = run()
                except Exception as e:  # noqa: BLE001 - a block shape too large for this GPU
                    print(f"{name} {algo} {config}: {type(e).__name__}", flush=True)
                    continue
                err = float((got.float() - expected).norm() / expected.norm())
                us = time_us(run)
                label = "cublas" if config == kernels.CUBLAS else "tensor-cores" \
                    if isinstance(config, kernels.MmaConfig) else kernel
                rows.append({"shape": name, "kind": algo or "bf16", "rows": m, "kernel": label, "config": list(config),
                             "us": us, "GB/s": layer.nbytes / us / 1e3, "of_copy": layer.nbytes / us / 1e3 / bandwidth,
                             "rel_err": err})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            kernels.gluon_available = available
    return rows


def run(portable: bool, kinds: str, rows: str, out: str | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda")) / 1e9
    print(f"copy bandwidth {bandwidth:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    measured = [row for m in map(int, rows.split(",")) for kind in kinds.split(",") for name in SHAPES
            for row in bench_shape(name, ALGOS[kind], bandwidth, portable, g, m)]
    best = {}
    for row in measured:
        key = (row["rows"], row["shape"], row["kind"], row["kernel"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    print("\nfastest per shape, kind and kernel:")
    for (m, shape, kind, kernel), row in sorted(best.items()):
        print(f"  {m} × {kind:5} {shape:12} {kernel:12} {row['us']:8.1f} us {row['GB/s']:7.0f} GB/s "
              f"{100 * row['of_copy']:5.1f}% of copy  rel err {row['rel_err']:.1e}  {row['config']}")
    if out:
        Path(out).write_text(json.dumps({"copy_GBps": bandwidth, "device": torch.cuda.get_device_name(),
                                        "rows": measured}, indent=1))

