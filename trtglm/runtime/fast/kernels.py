"""Triton kernels of the fast runtime: the fused steps between the matmuls, decode attention, the matmuls.

Each step kernel has a torch twin in `ops.TorchOps` that defines what it computes, and the
matmuls compute x · (stored weights × per-row scale)ᵀ as linear.py's dequantized weights do;
tests compare them (under Triton's interpreter on the CPU, natively on a GPU). Shapes follow the fast
model: activations are `[tokens, features]` row-major, the KV cache of one layer is
`[slots, kv_heads, max_seq_len, head_size]`.

Decode attention is split-K ("flash decoding"): every (sequence, KV head, chunk of
`CHUNK` positions) is one program, which puts the `GROUP` query heads sharing that KV head
in one `[GROUP, head]` tile so the tensor cores do the dot products; a second kernel merges
the chunks through their log-sum-exp. Chunks past a sequence's end exit at once, so one
launch shape (fixed by the cache length) serves every length, as CUDA graphs need.

The matmuls: a one-row kernel for decoding one sequence (weights converted to float32 in
registers, products summed elementwise and reduced once; memory-bound for bf16 weights), on
the GPU a word-wide one-row kernel for int8/int4 weights (inline PTX, see below), and a
tensor-core kernel for several rows. Block shapes are chosen per (weight kind, row bucket,
shape) by timing the candidates at start-up (`tune`, CUDA-graph replays on a cold L2 cache),
cuBLAS included for float weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

DECODE_CHUNK = 256  # positions per decode-attention program
DECODE_BLOCK = 64  # positions per inner step
L2_FLUSH_BYTES = 128 << 20  # more than any GPU's L2 cache (H100/H200: 50 MB)


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) · weight) for `[T, H]` rows; no delta: (x, RMSNorm(x) · weight)."""
    rows, cols = x.shape
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, total, out, cols, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(4, block // 512)))
    return total, out


@triton.jit
def _rope_cache_kernel(qkv_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, qkv_stride,
                       slot_stride, head_stride, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                       ROT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1 query, H..H+KVH-1 key, then value
    d = tl.arange(0, D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    src = qkv_ptr + t * qkv_stride + head * D
    if head < H + KVH:
        rotated = d < ROT
        cos = tl.load(cos_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=1.0)
        sin = tl.load(sin_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=0.0)
        x = tl.load(src + d).to(tl.float32)
        partner = tl.load(src + (d ^ 1)).to(tl.float32)  # the other element of the (even, odd) pair
        y = x * cos + tl.where(d % 2 == 0, -partner, partner) * sin
        if head < H:
            tl.store(q_ptr + (t * H + head) * D + d, y.to(q_ptr.dtype.element_ty))
        else:
            tl.store(k_ptr + slot * slot_stride + (head - H) * head_stride + pos * D + d, y.to(k_ptr.dtype.element_ty))
    else:
        tl.store(v_ptr + slot * slot_stride + (head - H - KVH) * head_stride + pos * D + d, tl.load(src + d))


def rope_cache(qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate q and k of `qkv` `[T, (H + 2·KVH)·D]`, store k/v at (slot, position) of the cache; q `[T, H, D]`."""
    tokens = qkv.shape[0]
    kv_heads, head = k_cache.shape[1], k_cache.shape[3]
    q = torch.empty(tokens, num_heads, head, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(tokens, num_heads + 2 * kv_heads)](
        qkv, slots, positions, cos, sin, q, k_cache, v_cache, qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        H=num_heads, KVH=kv_heads, D=head, ROT=2 * cos.shape[1], num_warps=1)
    return q


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, lse_ptr, scale, slot_stride,
                             head_stride, H: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    end = tl.minimum(split * CHUNK + CHUNK, tl.load(pos_ptr + b) + 1)
    g = tl.arange(0, GROUP_PAD)  # query heads of this KV head, padded to a tensor-core tile
    head_ok = g < GROUP
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
    base = slot * slot_stride + kv_head * head_stride
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for start in range(split * CHUNK, end, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < end
        k = tl.load(k_ptr + base + idx[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + idx[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    row = (b * H + heads) * SPLITS + split
    filled = total > 0
    tl.store(o_ptr + row[:, None] * D + d[None, :], acc / tl.where(filled, total, 1.0)[:, None],
             mask=head_ok[:, None])
    tl.store(lse_ptr + row, tl.where(filled, m + tl.log(total), float("-inf")), mask=head_ok)


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # sequence × query head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + row * SPLITS + s)
    weight = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(o_ptr + (row * SPLITS + s)[:, None] * D + d[None, :])
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """One query per sequence `q` `[B, H, D]` over cache positions 0..position of its slot; `[B, H·D]`."""
    batch, num_heads, head = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    splits = triton.next_power_of_2(triton.cdiv(max_len, DECODE_CHUNK))
    parts = torch.empty(batch, num_heads, splits, head, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, slots, positions, parts, lse, head ** -0.5, k_cache.stride(0), k_cache.stride(1),
        H=num_heads, GROUP=num_heads // kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_heads // kv_heads)),
        D=head, CHUNK=DECODE_CHUNK, BLOCK=DECODE_BLOCK, SPLITS=splits,
        num_warps=4, num_stages=2)
    out = torch.empty(batch, num_heads * head, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(batch * num_heads,)](parts, lse, out, D=head, SPLITS=splits, num_warps=2)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < F
    up = tl.load(x_ptr + t * 2 * F + i, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(x_ptr + t * 2 * F + F + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * F + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of `[T, 2F]` rows holding [up; gate]: silu(gate) · up, `[T, F]`."""
    tokens, width = x.shape
    inner = width // 2
    out = torch.empty(tokens, inner, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(inner, block))](x, out, inner, BLOCK=block, num_warps=4)
    return out


# --- weight-only matmuls ------------------------------------------------------------------------------------------
# Weight storage kinds: FLOAT ([N, K] in the compute dtype), INT8 ([N, K] uint8 holding q + 128, float32 scale per
# row) and INT4 ([N, K/2] uint8: byte j of a row holds q[j] + 8 in its low nibble and q[j + K/2] + 8 in its high
# one, so both halves of the input row meet contiguous weight bytes and no shuffling is needed).
FLOAT, INT8, INT4 = 0, 1, 2


@triton.jit
def _weights_as(w, dtype, WEIGHT: tl.constexpr, HIGH: tl.constexpr):
    """The weight values of a loaded tile (one nibble of it for INT4), in `dtype`."""
    if WEIGHT == 2:
        if HIGH:
            values = (w >> 4).to(tl.int8) - 8
        else:
            values = (w & 15).to(tl.int8) - 8
    elif WEIGHT == 1:
        values = (w ^ 0x80).to(tl.int8, bitcast=True)
    else:
        values = w
    return values.to(dtype)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] = x[M, K] · Ŵᵀ (tensor cores, several rows); K counts stored columns (K/2 bytes for INT4)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_cols = 2 * K if WEIGHT == 2 else K
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_cols
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.dot(x, tl.trans(_weights_as(w, x.dtype, WEIGHT, False)))
        if WEIGHT == 2:
            x_high = tl.load(x_rows + K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x_high, tl.trans(_weights_as(w, x.dtype, WEIGHT, True)))
    if WEIGHT != 0:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv_input(x_ptr, kk, k_ok, INNER, SWIGLU: tl.constexpr):
    """float32 input features kk; with SWIGLU the input row is [up; gate] (2·INNER wide) and this is silu(gate)·up."""
    if SWIGLU:
        up = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        gate = tl.load(x_ptr + INNER + kk, mask=k_ok, other=0.0).to(tl.float32)
        value = gate * tl.sigmoid(gate) * up
    else:
        value = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    return value


@triton.jit
def _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, factor, WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store the row sums of `acc` × scale (× factor) + bias at rows rn."""
    y = tl.sum(acc, axis=1)
    if WEIGHT != 0:
        y = y * (tl.load(scale_ptr + rn, mask=n_ok, other=0.0) * factor)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _weights_f32(w, WEIGHT: tl.constexpr, HIGH: tl.constexpr):
    """float32 weight values of a loaded tile without int→float conversion instructions (a Hopper SM
    converts 16 values per clock, too few to keep up with memory): an integer v in 0..2^23 added to the
    bits of 2^23 gives the float 2^23 + v exactly, and one float subtraction leaves v (minus the bias)."""
    if WEIGHT == 0:
        values = w.to(tl.float32)
    elif WEIGHT == 1:
        values = (w.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
    else:
        nibble = (w.to(tl.int32) >> 4) if HIGH else (w.to(tl.int32) & 15)
        values = (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8
    return values


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, WEIGHT: tl.constexpr, SWIGLU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[N] = x[K_in] · Ŵᵀ for one row: products accumulate elementwise, one reduction at the end."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    inner = 2 * K if WEIGHT == 2 else K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        x = _gemv_input(x_ptr, kk, k_ok, inner, SWIGLU)
        acc += _weights_f32(w, WEIGHT, False) * x[None, :]
        if WEIGHT == 2:
            x_high = _gemv_input(x_ptr, K + kk, k_ok, inner, SWIGLU)
            acc += _weights_f32(w, WEIGHT, True) * x_high[None, :]
    _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, 1.0, WEIGHT, HAS_BIAS)


# The one-row int8/int4 kernel on the GPU works on whole 32-bit words of weights (4 int8 or 8 int4 values) in
# inline PTX, because per-value integer work bounds the portable kernel above: a byte (or nibble) placed under the
# exponent of 1024 by one `prmt` (or `lop3`) is the half-precision float 1024 + value, two per register, and one
# packed subtraction leaves the signed values; packed half-precision multiply-adds with the inputs (scaled by
# WORD_INPUT_SCALE so that a word's partial sum stays far from half precision's 65504) give one float32 partial sum
# per word.
WORD_INPUT_SCALE = tl.constexpr(1.0 / 32)
_INT8_WORD_DOT = tl.constexpr("""{
.reg .b32 m, k, p0, p1, acc;
.reg .b16 h0, h1;
.reg .f32 f;
mov.b32 m, 0x64646464;
mov.b32 k, 0x64806480;
prmt.b32 p0, $1, m, 0x4140;
prmt.b32 p1, $1, m, 0x4342;
sub.f16x2 p0, p0, k;
sub.f16x2 p1, p1, k;
mul.f16x2 acc, p0, $2;
fma.rn.f16x2 acc, p1, $3, acc;
mov.b32 {h0, h1}, acc;
add.f16 h0, h0, h1;
cvt.f32.f16 f, h0;
mov.b32 $0, f;
}""")  # bytes 0,1 and 2,3 of the word (stored q + 128) → (1024 + u) pairs − 1152 → q; · input pairs; summed
_INT4_WORD_DOT = tl.constexpr("""{
.reg .b32 m, k, t, p0, p1, p2, p3, acc;
.reg .b16 h0, h1;
.reg .f32 f;
mov.b32 m, 0x64006400;
mov.b32 k, 0x64086408;
lop3.b32 p0, $1, 0x000F000F, m, 0xEA;
shr.b32 t, $1, 4;
lop3.b32 p1, t, 0x000F000F, m, 0xEA;
shr.b32 t, $1, 8;
lop3.b32 p2, t, 0x000F000F, m, 0xEA;
shr.b32 t, $1, 12;
lop3.b32 p3, t, 0x000F000F, m, 0xEA;
sub.f16x2 p0, p0, k;
sub.f16x2 p1, p1, k;
sub.f16x2 p2, p2, k;
sub.f16x2 p3, p3, k;
mul.f16x2 acc, p0, $2;
fma.rn.f16x2 acc, p1, $3, acc;
fma.rn.f16x2 acc, p2, $4, acc;
fma.rn.f16x2 acc, p3, $5, acc;
mov.b32 {h0, h1}, acc;
add.f16 h0, h0, h1;
cvt.f32.f16 f, h0;
mov.b32 $0, f;
}""")  # nibbles (0, 4), (1, 5), (2, 6), (3, 7) of the word (stored q + 8) → (1024 + u) pairs − 1032 → q; as above


@triton.jit
def _half_pairs(a, b, shape):
    """int32 words holding (half(a), half(b)), a in the low 16 bits (one conversion), broadcast to `shape`."""
    pairs = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)
    return tl.broadcast_to(pairs[None, :], shape)


@triton.jit
def _four_inputs(x_ptr, first, ok, INNER, SWIGLU: tl.constexpr):
    """Inputs first .. first+3 (`first` a vector), scaled by WORD_INPUT_SCALE."""
    x0 = _gemv_input(x_ptr, first, ok, INNER, SWIGLU)
    x1 = _gemv_input(x_ptr, first + 1, ok, INNER, SWIGLU)
    x2 = _gemv_input(x_ptr, first + 2, ok, INNER, SWIGLU)
    x3 = _gemv_input(x_ptr, first + 3, ok, INNER, SWIGLU)
    return x0 * WORD_INPUT_SCALE, x1 * WORD_INPUT_SCALE, x2 * WORD_INPUT_SCALE, x3 * WORD_INPUT_SCALE


@triton.jit
def _gemv_words_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, WORDS, WEIGHT: tl.constexpr,
                       SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """y[N] = x · Ŵᵀ for one row, INT8/INT4 weights read as `[N, WORDS]` int32 words (GPU only)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    n_ok = rn < N
    inner = 8 * WORDS if WEIGHT == 2 else 4 * WORDS  # input features
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * WORDS
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    shape: tl.constexpr = (BLOCK_N, BLOCK_W)
    for c0 in range(0, WORDS, BLOCK_W):
        cw = c0 + rw
        c_ok = cw < WORDS
        w = tl.load(w_rows + cw[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0)
        x0, x1, x2, x3 = _four_inputs(x_ptr, 4 * cw, c_ok, inner, SWIGLU)
        if WEIGHT == 1:  # word c holds inputs 4c .. 4c+3
            part = tl.inline_asm_elementwise(_INT8_WORD_DOT, "=r,r,r,r",
                                             [w, _half_pairs(x0, x1, shape), _half_pairs(x2, x3, shape)],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:  # low nibbles: inputs 4c .. 4c+3; high nibbles: the same in the second half of the row
            h0, h1, h2, h3 = _four_inputs(x_ptr, 4 * WORDS + 4 * cw, c_ok, inner, SWIGLU)
            part = tl.inline_asm_elementwise(
                _INT4_WORD_DOT, "=r,r,r,r,r,r",
                [w, _half_pairs(x0, x2, shape), _half_pairs(h0, h2, shape), _half_pairs(x1, x3, shape),
                 _half_pairs(h1, h3, shape)], dtype=tl.int32, is_pure=True, pack=1)
        acc += part.to(tl.float32, bitcast=True)
    _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, 1.0 / WORD_INPUT_SCALE, WEIGHT, HAS_BIAS)


def graph_time_ms(fn, calls: int = 10, replays: int = 5) -> float:
    """Median time of one call of `fn` on a cold L2 cache, replayed from a CUDA graph as decode steps run
    (launching from Python would time the host, and repeating one call would read its weights from L2):
    a graph of `calls` × (overwrite L2_FLUSH_BYTES, fn), less the same graph without fn."""
    flush, flush_ms = _l2_flush(calls, replays)
    return _replay_ms(lambda: (flush.zero_(), fn()), calls, replays) - flush_ms


@functools.cache
def _l2_flush(calls: int, replays: int) -> tuple[torch.Tensor, float]:
    """The buffer `graph_time_ms` overwrites to empty the L2 cache, and the time of overwriting it."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return flush, _replay_ms(flush.zero_, calls, replays)


def _replay_ms(body, calls: int, replays: int) -> float:
    """Median time of one call of `body`, from `replays` replays of a CUDA graph of `calls` calls."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def words_kernel_available() -> bool:
    """The word-wide kernel needs a real GPU (Triton's interpreter does not run inline PTX)."""
    return not triton.knobs.runtime.interpret


class Config(NamedTuple):
    block_m: int  # 0: the one-row kernel; -1: cuBLAS (float weights)
    block_n: int
    block_k: int  # stored columns (bytes for INT8/INT4); the tensor-core kernel takes half as many INT4 bytes
    warps: int
    stages: int
    fuse_swiglu: bool = True  # the one-row kernel applies SwiGLU to its input (else a separate kernel does)


def _configs(block_m: int, *shapes: tuple[int, int, int, int]) -> list[Config]:
    return [Config(block_m, *shape) for shape in shapes]


# Candidates per row bucket (1: the one-row kernel); `tune` times them, else the first one is used unless
# CHOSEN has an entry.
CANDIDATES: dict[int, list[Config]] = {
    1: _configs(0, (8, 512, 4, 4), (16, 256, 4, 4), (4, 1024, 4, 4), (16, 512, 8, 3), (8, 1024, 8, 3),
                (16, 1024, 8, 3), (32, 512, 4, 3), (64, 256, 4, 3), (16, 512, 2, 4), (8, 1024, 2, 4), (32, 256, 2, 4)),
    16: _configs(16, (32, 256, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3), (16, 512, 4, 4), (64, 128, 4, 5)),
    32: _configs(32, (32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 5), (128, 128, 4, 4)),
    64: _configs(64, (32, 256, 4, 4), (64, 256, 4, 4), (64, 128, 4, 5), (128, 128, 4, 4), (128, 64, 8, 4),
                 (128, 128, 8, 4), (256, 64, 8, 4), (64, 128, 4, 6), (128, 64, 4, 6)),
    128: [Config(64, 128, 64, 4, 4), Config(128, 128, 64, 8, 3), Config(128, 256, 64, 8, 3), Config(64, 256, 64, 8, 4)],
}
# The word-wide one-row kernel (int8/int4 on the GPU): block_k counts stored bytes, four to a word.
WORD_CANDIDATES = _configs(0, (16, 512, 4, 4), (32, 512, 4, 3), (64, 512, 4, 3), (8, 512, 2, 4), (16, 512, 2, 4),
                           (32, 256, 2, 4), (16, 1024, 4, 3), (64, 256, 4, 3), (8, 256, 1, 4), (16, 256, 1, 4),
                           (32, 1024, 8, 3), (128, 256, 8, 3), (32, 512, 2, 3), (64, 512, 8, 3))
CUBLAS = Config(-1, 0, 0, 0, 0)
CHOSEN: dict[tuple, Config] = {}  # (weight kind, row bucket, N, K, swiglu) -> config


def row_bucket(m: int) -> int:
    return 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, weight: int,
           swiglu: bool = False, config: Config | None = None) -> torch.Tensor:
    """x `[M, K_in]` · Ŵᵀ + bias, Ŵ = stored weight × per-row scale, accumulated in float32; `[M, N]`.

    `swiglu`: x rows are [up; gate] and the input is silu(gate)·up (one-row kernel only).
    """
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    config = config or CHOSEN.get(_key(x, w, weight, swiglu)) or default_config(weight, m)
    if config == CUBLAS:
        return F.linear(silu_mul(x) if swiglu else x, w, bias)
    bm, bn, bk, warps, stages, fuse_swiglu = config
    if swiglu and (bm or not fuse_swiglu):
        x, swiglu = silu_mul(x), False
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    scale_arg = scale if scale is not None else w
    bias_arg = bias if bias is not None else w
    if bm == 0 and weight != FLOAT and k % 4 == 0 and words_kernel_available():
        _gemv_words_kernel[(triton.cdiv(n, bn),)](x, w.view(torch.int32), scale_arg, bias_arg, y, n, k // 4,
                                                  WEIGHT=weight, SWIGLU=swiglu, HAS_BIAS=bias is not None,
                                                  BLOCK_N=bn, BLOCK_W=bk // 4, num_warps=warps, num_stages=stages)
    elif bm == 0:
        _gemv_kernel[(triton.cdiv(n, bn),)](x, w, scale_arg, bias_arg, y, n, k, WEIGHT=weight, SWIGLU=swiglu,
                                            HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
                                            num_warps=warps, num_stages=stages)
    else:
        _matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            x, w, scale_arg, bias_arg, y, m, n, k, WEIGHT=weight, HAS_BIAS=bias is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk // 2 if weight == INT4 else bk, num_warps=warps, num_stages=stages)
    return y


def candidates(weight: int, bucket: int) -> list[Config]:
    """The block shapes `tune` times for a weight kind and row bucket (cuBLAS is added for float weights)."""
    if bucket == 1 and weight != FLOAT and words_kernel_available():
        return WORD_CANDIDATES
    return CANDIDATES[bucket]


def default_config(weight: int, rows: int) -> Config:
    """Untuned: cuBLAS for float weights, else the first candidate of the row bucket."""
    return CUBLAS if weight == FLOAT else candidates(weight, row_bucket(rows))[0]


def _key(x: torch.Tensor, w: torch.Tensor, weight: int, swiglu: bool) -> tuple:
    return weight, row_bucket(x.shape[0]), w.shape[0], w.shape[1], swiglu


def tune(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, weight: int,
         swiglu: bool = False) -> Config:
    """Time the candidates (and cuBLAS, for float weights) on this shape; remember and return the fastest."""
    key = _key(x, w, weight, swiglu)
    if weight == FLOAT and key[1] == 128:
        CHOSEN[key] = CUBLAS  # prompts: compute-bound, cuBLAS's ground
    if key not in CHOSEN:
        options = list(candidates(weight, key[1])) + ([CUBLAS] if weight == FLOAT else [])
        if swiglu and key[1] == 1:  # fused SwiGLU recomputes silu in every program: time it against a kernel of its own
            options += [c._replace(fuse_swiglu=False) for c in candidates(weight, 1)]
        timings = {}
        for config in options:
            try:
                timings[config] = graph_time_ms(lambda c=config: matmul(x, w, scale, bias, weight, swiglu, c))
            except OutOfResources:  # too large a tile for this GPU
                continue
        CHOSEN[key] = min(timings, key=timings.get)
    return CHOSEN[key]
