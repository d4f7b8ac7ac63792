"""The random part of sampling: Gumbel noise from a counter-based hash.

A sampled row's token is the argmax of its scores (logits over the temperature, the ids that top-k
and top-p drop at -inf) plus Gumbel noise g = -log(-log u), one u in (0, 1) per id: the Gumbel-max
rule, which draws from softmax(scores) exactly. u comes from a hash of the row's key and the id,
the key from a hash of the request's 64-bit seed and how many tokens it has drawn so far, so a
request's draws depend on nothing else: not on which requests share the step, nor on their order
or batch size. The same seed gives the same tokens, alone or in any batch.

The hash is `lowbias32` (C. Wellons' 32-bit integer mixer): u = ((h >> 9) + 0.5) / 2^23. Two
implementations of the same integers: numpy's uint32 arithmetic on the host (`uniform_bits`, for
rows on the CPU), and one Triton kernel on a GPU that hashes, adds and takes each row's argmax in
one pass over the scores (fast/sampling_kernel.py). They agree bit for bit on u and to rounding
on g (tests/runtime/test_sampling.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # spreads consecutive ids before mixing
MIX = (0x7FEB352D, 0x846CA68B)  # lowbias32's multipliers
BITS = 23  # u has 23 random bits: (m + 0.5) / 2^23 is exact in float32 and never 0 or 1
BLOCK = 4096  # ids per iteration of the GPU kernel


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 of uint32 values (numpy's uint32 products wrap and its shifts are logical, as it wants)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(MIX[0])
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(MIX[1])
    return x ^ (x >> np.uint32(16))


def row_keys(seeds: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """Each row's key (uint32) from its seed (int64: a uint64 seed's bits) and draw count."""
    bits = seeds.astype(np.int64).view(np.uint64)
    low, high = (bits & np.uint64(M32)).astype(np.uint32), (bits >> np.uint64(32)).astype(np.uint32)
    return mix32(mix32(mix32(low) ^ high) ^ drawn.astype(np.int64).view(np.uint64).astype(np.uint32))


def uniform_bits(seeds: np.ndarray, drawn: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The hash (uint32 `[rows, ids]`) of each row's key and ids `cols` (`[rows, ids]`, or `[ids]` for all)."""
    keys = row_keys(seeds, drawn)[:, None]
    return mix32(keys + cols.astype(np.int64).view(np.uint64).astype(np.uint32) * np.uint32(GOLDEN))


def gumbel_noise(seeds: torch.Tensor, drawn: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise `[rows, ids]` of ids `cols` (`[rows, ids]`, or `[ids]` shared by every row), on the
    devices of `cols` (computed on the host)."""
    bits = uniform_bits(*(t.cpu().numpy() for t in (seeds, drawn, cols)))
    u = ((bits >> np.uint32(32 - BITS)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -BITS)
    return torch.from_numpy(-np.log(-np.log(u))).to(cols.device)


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, drawn: torch.Tensor,
                  cols: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's id (int64 `[rows]`) with the greatest score plus its noise: `scores` float32 `[rows, n]`, the
    ids `cols` of its columns (int64 `[rows, n]`; None: column j is id j), each row's seed and draw count."""
    if scores.is_cuda and _triton() is not None:
        return _gumbel_argmax_gpu(scores, seeds, drawn, cols)
    ids = cols if cols is not None else torch.arange(scores.shape[-1], device=scores.device)
    best = (scores + gumbel_noise(seeds, drawn, ids)).argmax(dim=-1)
    return best if cols is None else cols.gather(1, best[:, None])[:, 0]


@functools.cache
def _triton():
    """Triton's module, or None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def _gumbel_argmax_gpu(scores: torch.Tensor, seeds: torch.Tensor, drawn: torch.Tensor,
                       cols: torch.Tensor | None) -> torch.Tensor:
    from trtglm.runtime.fast.sampling_kernel import gumbel_argmax_kernel

    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        has_cols = cols is not None
        # Copies: a column of the chooser's table may start off Triton's 16-byte alignment, for which it compiles a
        # kernel of its own.
        gumbel_argmax_kernel[(rows,)](scores, scores.stride(0), cols if has_cols else scores,
                                      cols.stride(0) if has_cols else 0, seeds.clone(), drawn.clone(), out,
                                      n, HAS_COLS=has_cols, BLOCK=BLOCK, num_warps=8)
    return out
