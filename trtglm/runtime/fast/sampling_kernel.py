"""The Gumbel-max draw of gumbel.py as one Triton kernel: each program takes one row, hashes each id's
noise as `gumbel.gumbel_noise` does (the same uint32 arithmetic: products wrap, shifts are logical),
adds it to the row's scores and keeps the id of the greatest sum, a block of ids at a time."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix(x):
    """lowbias32 (gumbel.mix32) of uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def gumbel_argmax_kernel(scores, score_stride, cols, col_stride, seeds, drawn, out, n,
                         HAS_COLS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds + row)
    key = _mix(_mix(_mix(seed.to(tl.uint32)) ^ (seed >> 32).to(tl.uint32)) ^ tl.load(drawn + row).to(tl.uint32))
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        offsets = start + lanes
        inside = offsets < n
        score = tl.load(scores + row * score_stride + offsets, mask=inside, other=float("-inf"))
        if HAS_COLS:
            ids = tl.load(cols + row * col_stride + offsets, mask=inside, other=0)
        else:
            ids = offsets.to(tl.int64)
        bits = _mix(key + ids.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        value = tl.where(inside, score - tl.log(-tl.log(u)), float("-inf"))
        top = tl.max(value, axis=0)
        at = tl.argmax(value, axis=0)
        top_id = tl.sum(tl.where(lanes == at, ids, 0), axis=0)
        better = top > best
        best_id = tl.where(better, top_id, best_id)
        best = tl.where(better, top, best)
    tl.store(out + row, best_id)
