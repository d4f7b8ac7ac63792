"""The INT8/INT4 decode matmuls on the GPU, in Gluon (Triton with explicit layouts): one-row kernels for INT8
(`gemv_words_kernel`) and INT4 (`gemv_pairs_kernel`), and a tensor-core kernel for 1 to 8 rows
(`gemv_mma_kernel`, described below them).

Weights are kernels.py's planar words. In the one-row kernels each thread holds ROWS rows × VEC words of a tile;
the input pairs those words need are loaded once per plane (one vector load, in the layout of the words),
converted once to half precision and reused for every row the thread holds. Plain Triton chose its own layout for
the inputs and moved them through shared memory with a barrier per plane, which made the L1 pipe, not DRAM, the
limit (docs/benchmarks.md).

A word's pair placed under the exponent of 1024 by one `prmt` (INT8) or `lop3` (INT4) is the half-precision pair
1024 + stored value; one packed subtraction or multiply-add leaves the signed values, and packed half-precision
multiply-adds with the input pairs give one float32 partial sum per word (INT8, inputs scaled by
WORD_INPUT_SCALE so that a word's partial sum stays far from half precision's 65504) or per two words (INT4,
weights scaled by 1/32 instead, so the input is only converted). With SWIGLU (INT8) the input row is [up; gate] and
the kernel applies silu(gate) · up as it converts it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

WORD_INPUT_SCALE = gl.constexpr(1.0 / 32)
INT8_WORD_DOT = gl.constexpr("""{
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
}""")  # bytes (0, 1) and (2, 3): planes 0 and 1, stored q + 128 → (1024 + u) pairs − 1152 → q; · input pairs; summed
INT4_PAIR_DOT = gl.constexpr("""{
.reg .b32 m, s0, k0, s1, k1, ta, tb, a0, a1, a2, a3, b0, b1, b2, b3, acc;
.reg .b16 h0, h1;
.reg .f32 f;
mov.b32 m, 0x64006400;
mov.b32 s0, 0x28002800;
mov.b32 k0, 0xD008D008;
mov.b32 s1, 0x18001800;
mov.b32 k1, 0xC080C080;
shr.b32 ta, $1, 8;
shr.b32 tb, $2, 8;
lop3.b32 a0, $1, 0x000F000F, m, 0xEA;
lop3.b32 a1, $1, 0x00F000F0, m, 0xEA;
lop3.b32 a2, ta, 0x000F000F, m, 0xEA;
lop3.b32 a3, ta, 0x00F000F0, m, 0xEA;
lop3.b32 b0, $2, 0x000F000F, m, 0xEA;
lop3.b32 b1, $2, 0x00F000F0, m, 0xEA;
lop3.b32 b2, tb, 0x000F000F, m, 0xEA;
lop3.b32 b3, tb, 0x00F000F0, m, 0xEA;
fma.rn.f16x2 a0, a0, s0, k0;
fma.rn.f16x2 a1, a1, s1, k1;
fma.rn.f16x2 a2, a2, s0, k0;
fma.rn.f16x2 a3, a3, s1, k1;
fma.rn.f16x2 b0, b0, s0, k0;
fma.rn.f16x2 b1, b1, s1, k1;
fma.rn.f16x2 b2, b2, s0, k0;
fma.rn.f16x2 b3, b3, s1, k1;
mul.f16x2 acc, a0, $3;
fma.rn.f16x2 acc, a1, $4, acc;
fma.rn.f16x2 acc, a2, $5, acc;
fma.rn.f16x2 acc, a3, $6, acc;
fma.rn.f16x2 acc, b0, $7, acc;
fma.rn.f16x2 acc, b1, $8, acc;
fma.rn.f16x2 acc, b2, $9, acc;
fma.rn.f16x2 acc, b3, $10, acc;
mov.b32 {h0, h1}, acc;
add.f16 h0, h0, h1;
cvt.f32.f16 f, h0;
mov.b32 $0, f;
}""")  # words $1, $2 with input pairs $3-$6 and $7-$10 (planes 0-3). Planes 0, 2: nibbles at bits 0-3 (of the word
# and of it >> 8) → (1024 + u) / 32 − 32.25 = q / 32; planes 1, 3: nibbles at bits 4-7 → (1024 + 16u) / 512 − 2.25 =
# q / 32 (each one exact fma); then 16 products summed in half precision, once into float32

HALF_PAIR = gl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # (low, high) float32 → one word of two halves


@gluon.jit
def _start(PDL: gl.constexpr):
    """As kernels._start: wait for the previous kernel, then let the next one launch (programmatic dependent
    launch)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@gluon.jit
def _features(u, X_BF16: gl.constexpr):
    """The two float32 features of int32 words holding 16-bit pairs (feature 2i in the low half)."""
    if X_BF16:
        low = (u << 16).to(gl.float32, bitcast=True)
        high = (u & -65536).to(gl.float32, bitcast=True)
    else:
        low = (u & 65535).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        high = (u >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return low, high


@gluon.jit
def _silu(gate):
    return gl.fdiv(gate, 1.0 + gl.exp(-gate))


@gluon.jit
def _input_pairs(pairs_ptr, offsets, ok, gate_offset, X_BF16: gl.constexpr, SWIGLU: gl.constexpr):
    """Input pairs `offsets` × WORD_INPUT_SCALE as half-precision pairs in int32 words, as one row `[1, VEC·…]`."""
    low, high = _features(gl.load(pairs_ptr + offsets, mask=ok, other=0), X_BF16)
    if SWIGLU:
        gate_low, gate_high = _features(gl.load(pairs_ptr + gate_offset + offsets, mask=ok, other=0), X_BF16)
        low = low * _silu(gate_low)
        high = high * _silu(gate_high)
    halves = gl.inline_asm_elementwise(HALF_PAIR, "=r,f,f", [low * WORD_INPUT_SCALE, high * WORD_INPUT_SCALE],
                                       dtype=gl.int32, is_pure=True, pack=1)
    return gl.expand_dims(halves, 0)


@gluon.jit
def gemv_words_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, partial_ptr, arrived_ptr, N, WORDS, CHUNK,
                      X_BF16: gl.constexpr, SWIGLU: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ROWS: gl.constexpr, VEC: gl.constexpr, WARPS_N: gl.constexpr, WARPS_W: gl.constexpr,
                      PREFETCH: gl.constexpr, SPLIT: gl.constexpr, PDL: gl.constexpr):
    """y[N] = x · Ŵᵀ for one 16-bit input row and `[N, WORDS]` planar INT8 words.

    Program (i, s) takes rows i·BLOCK_N… and words s·CHUNK…; with SPLIT (more than one s), each writes its
    float32 partial sums to `partial_ptr[s, N]` and counts itself in `arrived_ptr[i]`, and the last of a row block
    to arrive adds the partials, writes y and resets its counter to 0 (no second launch). PREFETCH loads the next
    tile of words before working on this one; the first is loaded before waiting for the kernel before."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS, VEC], [1, 32], [WARPS_N, WARPS_W], [1, 0])
    BLOCK_N: gl.constexpr = ROWS * WARPS_N
    BLOCK_W: gl.constexpr = VEC * 32 * WARPS_W
    PLANES: gl.constexpr = 2
    rn = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    rw = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, layout))
    start = gl.program_id(1) * CHUNK
    stop = gl.minimum(start + CHUNK, WORDS)
    rows_ok = rn < N
    n_ok = gl.expand_dims(rows_ok, 1)
    pairs_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    gate = PLANES * WORDS  # pairs before the gate half of a SWIGLU input row
    w_rows = w_ptr + gl.expand_dims(rn.to(gl.int64) * WORDS, 1)
    acc = gl.zeros([BLOCK_N, BLOCK_W], gl.float32, layout)
    w = gl.load(w_rows + gl.expand_dims(start + rw, 0), mask=n_ok & gl.expand_dims(start + rw < stop, 0), other=0)
    _start(PDL)  # the first weights are in flight; the input comes from the kernel before
    for c0 in range(start, stop, BLOCK_W):
        cw = c0 + rw
        ahead = w_rows + gl.expand_dims(cw + BLOCK_W, 0)
        ahead_ok = n_ok & gl.expand_dims(cw + BLOCK_W < stop, 0)
        if PREFETCH:
            w_next = gl.load(ahead, mask=ahead_ok, other=0)
        acc += _tile_dot(w, cw, cw < stop, pairs_ptr, WORDS, gate, X_BF16, SWIGLU)
        if PREFETCH:
            w = w_next
        else:
            w = gl.load(ahead, mask=ahead_ok, other=0)
    y = gl.sum(acc, axis=1) * (gl.load(scale_ptr + rn, mask=rows_ok, other=0.0) / WORD_INPUT_SCALE)
    if SPLIT:
        _store_partial(y, partial_ptr, gl.program_id(1), rn, 0, 1, N)
        if _arrived_last(arrived_ptr, WARPS_N * WARPS_W):
            _store_rows(_sum_partials(y, partial_ptr, rn, 0, 1, N), rn, rows_ok, bias_ptr, y_ptr, HAS_BIAS)
    else:
        _store_rows(y, rn, rows_ok, bias_ptr, y_ptr, HAS_BIAS)


@gluon.jit
def _tile_dot(w, cw, c_ok, pairs_ptr, WORDS, gate, X_BF16: gl.constexpr, SWIGLU: gl.constexpr):
    """float32 partial sums, one per INT8 word of the tile `w` (words cw of each row)."""
    x0 = _input_pairs(pairs_ptr, cw, c_ok, gate, X_BF16, SWIGLU)
    x1 = _input_pairs(pairs_ptr, WORDS + cw, c_ok, gate, X_BF16, SWIGLU)
    part = gl.inline_asm_elementwise(INT8_WORD_DOT, "=r,r,r,r", [w, x0, x1], dtype=gl.int32, is_pure=True, pack=1)
    return part.to(gl.float32, bitcast=True)


@gluon.jit
def gemv_pairs_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, WORDS: gl.constexpr, X_BF16: gl.constexpr,
                      HAS_BIAS: gl.constexpr, EVEN_N: gl.constexpr, ROWS: gl.constexpr, VEC: gl.constexpr,
                      WARPS_N: gl.constexpr, WARPS_W: gl.constexpr, PDL: gl.constexpr):
    """y[N] = x · Ŵᵀ for one 16-bit input row and `[N, WORDS]` planar INT4 words, two words per partial sum.

    A step takes two half tiles of BLOCK_N rows × HALF words (words c0… and c0 + HALF…) and pairs their words
    position by position in INT4_PAIR_DOT, so a float32 conversion and addition serve 16 weights. Both half tiles
    of the next step are loaded before working on this one; the first step's before waiting for the kernel before.
    WORDS is a compile-time constant, so each row's words lie at a fixed offset from the first row's."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS, VEC], [1, 32], [WARPS_N, WARPS_W], [1, 0])
    BLOCK_N: gl.constexpr = ROWS * WARPS_N
    HALF: gl.constexpr = VEC * 32 * WARPS_W
    EVEN_W: gl.constexpr = WORDS % (2 * HALF) == 0  # no step runs past the end of a row
    rn = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    rw = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(0, layout)), 0)
    n_ok = gl.expand_dims(rn < N, 1)
    pairs_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    w_rows = w_ptr + gl.expand_dims(rn.to(gl.int64) * WORDS, 1) + rw
    acc = gl.zeros([BLOCK_N, HALF], gl.float32, layout)
    a = _half_tile(w_rows, rw, n_ok, 0, True, WORDS, EVEN_N, EVEN_W)
    b = _half_tile(w_rows, rw, n_ok, HALF, True, WORDS, EVEN_N, EVEN_W)
    _start(PDL)  # the first weights are in flight; the input comes from the kernel before
    for c0 in range(0, WORDS, 2 * HALF):
        more = c0 + 2 * HALF < WORDS
        a_next = _half_tile(w_rows, rw, n_ok, c0 + 2 * HALF, more, WORDS, EVEN_N, EVEN_W)
        b_next = _half_tile(w_rows, rw, n_ok, c0 + 3 * HALF, more, WORDS, EVEN_N, EVEN_W)
        a0, a1, a2, a3 = _planes(pairs_ptr, rw + c0, WORDS, EVEN_W, X_BF16)
        b0, b1, b2, b3 = _planes(pairs_ptr, rw + c0 + HALF, WORDS, EVEN_W, X_BF16)
        part = gl.inline_asm_elementwise(INT4_PAIR_DOT, "=r,r,r,r,r,r,r,r,r,r,r",
                                         [a, b, a0, a1, a2, a3, b0, b1, b2, b3], dtype=gl.int32, is_pure=True, pack=1)
        acc += part.to(gl.float32, bitcast=True)
        a = a_next
        b = b_next
    rows_ok = rn < N
    y = gl.sum(acc, axis=1) * (gl.load(scale_ptr + rn, mask=rows_ok, other=0.0) * 32.0)  # the words hold q / 32
    _store_rows(y, rn, rows_ok, bias_ptr, y_ptr, HAS_BIAS)


@gluon.jit
def _half_tile(w_rows, rw, n_ok, c, more, WORDS: gl.constexpr, EVEN_N: gl.constexpr, EVEN_W: gl.constexpr):
    """Words c… of the rows `w_rows` (`[BLOCK_N, HALF]`; 0 past a row's end or the last row, and where not `more`).
    Read once per step, they are marked first to leave L2, which keeps the activations and the KV cache there."""
    if EVEN_N and EVEN_W:
        words = gl.load(w_rows + c, mask=more, eviction_policy="evict_first")
    else:
        words = gl.load(w_rows + c, mask=n_ok & (rw + c < WORDS) & more, other=0, eviction_policy="evict_first")
    return words


@gluon.jit
def _planes(pairs_ptr, words, WORDS: gl.constexpr, EVEN_W: gl.constexpr, X_BF16: gl.constexpr):
    """The input pairs of words `words` (`[1, HALF]`) in each of the 4 planes, as half-precision pairs."""
    ok = words < WORDS
    return (_half_pairs(pairs_ptr, words, ok, EVEN_W, X_BF16),
            _half_pairs(pairs_ptr, words + WORDS, ok, EVEN_W, X_BF16),
            _half_pairs(pairs_ptr, words + 2 * WORDS, ok, EVEN_W, X_BF16),
            _half_pairs(pairs_ptr, words + 3 * WORDS, ok, EVEN_W, X_BF16))


@gluon.jit
def _half_pairs(pairs_ptr, offsets, ok, EVEN_W: gl.constexpr, X_BF16: gl.constexpr):
    """Input pairs `offsets` (`[1, HALF]`) as half-precision pairs in int32 words (0 past the row unless EVEN_W)."""
    if EVEN_W:
        u = gl.load(pairs_ptr + offsets)
    else:
        u = gl.load(pairs_ptr + offsets, mask=ok, other=0)
    if X_BF16:
        low, high = _features(u, True)
        u = gl.inline_asm_elementwise(HALF_PAIR, "=r,f,f", [low, high], dtype=gl.int32, is_pure=True, pack=1)
    return u


@gluon.jit
def _store_rows(y, rn, rows_ok, bias_ptr, y_ptr, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        y += gl.load(bias_ptr + rn, mask=rows_ok, other=0.0).to(gl.float32)
    gl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rows_ok)


@gluon.jit
def _fence(WARPS: gl.constexpr):
    """fence.acq_rel.gpu, once in every thread."""
    one_each = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [one_each], dtype=gl.int32,
                              is_pure=False, pack=1)


# The tensor-core kernel for 1 to 8 input rows: mma.m16n8k16 with the weights as A (16 rows × 16 features) and the
# input rows as B (16 features × 8 rows, unused rows zero). Lane 4g + q of a warp holds word c of rows g and g + 8 of
# its 16-row block and, for input row g, the pairs of word c of every plane; the mma's k index is whatever order that
# gives (k 2q, 2q + 1 ← plane p, k 2q + 8, 2q + 9 ← plane p + 1), the same for both operands. The tensor cores do the
# products and keep the sums in float32, so a word costs only its unpacking: INT4 into bf16 (the nibble under the
# exponent of 128) or fp16 (of 1024), as the input is; INT8 into fp16 with the input converted to fp16 (× 1/32).


def _mma_asm(weight: int, x_bf16: bool) -> str:
    """PTX of one step on a pair of words (rows g, g + 8): $0-$3 ← accumulators $C.. + products."""
    if weight == 2:
        kind = "bf16" if x_bf16 else "f16"
        magic, fix = ("0x43004300", "fma.rn.bf16x2 {0}, {0}, one, nk;") if x_bf16 else \
            ("0x64006400", "sub.f16x2 {0}, {0}, nk;")
        consts = "mov.b32 one, 0x3F803F80;\nmov.b32 nk, 0xC308C308;" if x_bf16 else "mov.b32 nk, 0x64086408;"
        lines = [".reg .b32 m, one, nk, t, a0, a1, a2, a3;", f"mov.b32 m, {magic};", consts]
        for half, (b0, b1, c) in enumerate((("$6", "$7", "$10, $11, $12, $13"), ("$8", "$9", "$0, $1, $2, $3"))):
            for reg, word, plane in (("a0", "$4", 2 * half), ("a1", "$5", 2 * half), ("a2", "$4", 2 * half + 1),
                                     ("a3", "$5", 2 * half + 1)):
                source = word
                if plane:
                    lines.append(f"shr.b32 t, {word}, {4 * plane};")
                    source = "t"
                lines.append(f"lop3.b32 {reg}, {source}, 0x000F000F, m, 0xEA;")
            lines += [fix.format(reg) for reg in ("a0", "a1", "a2", "a3")]
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0, $1, $2, $3}}, "
                         f"{{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};")
    else:
        lines = [".reg .b32 m, nk, a0, a1, a2, a3;", "mov.b32 m, 0x64646464;", "mov.b32 nk, 0x64806480;",
                 "prmt.b32 a0, $4, m, 0x4140;", "prmt.b32 a1, $5, m, 0x4140;", "prmt.b32 a2, $4, m, 0x4342;",
                 "prmt.b32 a3, $5, m, 0x4342;"] + [f"sub.f16x2 {r}, {r}, nk;" for r in ("a0", "a1", "a2", "a3")] + [
                 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, "
                 "{$8, $9, $10, $11};"]
    return "{\n" + "\n".join(lines) + "\n}"


INT4_MMA_BF16 = gl.constexpr(_mma_asm(2, True))
INT4_MMA_F16 = gl.constexpr(_mma_asm(2, False))
INT8_MMA = gl.constexpr(_mma_asm(1, True))
_F32X4 = gl.constexpr((gl.float32, gl.float32, gl.float32, gl.float32))


@gluon.jit
def _mma_pairs(pairs_ptr, offsets, ok, WEIGHT: gl.constexpr, X_BF16: gl.constexpr):
    """Input pairs as the mma's B operand: as stored for INT4, fp16 × WORD_INPUT_SCALE for INT8."""
    u = gl.load(pairs_ptr + offsets, mask=ok, other=0)
    if WEIGHT == 1:
        low, high = _features(u, X_BF16)
        u = gl.inline_asm_elementwise(HALF_PAIR, "=r,f,f", [low * WORD_INPUT_SCALE, high * WORD_INPUT_SCALE],
                                      dtype=gl.int32, is_pure=True, pack=1)
    return u


@gluon.jit
def gemv_mma_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, partial_ptr, arrived_ptr, M, N, WORDS, CHUNK,
                    WEIGHT: gl.constexpr, X_BF16: gl.constexpr, HAS_BIAS: gl.constexpr, WARPS_N: gl.constexpr,
                    LANE_WORDS: gl.constexpr, SPLIT: gl.constexpr, PDL: gl.constexpr):
    """y[M, N] = x · Ŵᵀ for M ≤ 8 16-bit input rows and `[N, WORDS]` planar INT8/INT4 words, on tensor cores.

    Each warp takes 16 rows, each lane LANE_WORDS consecutive words of its two rows per step (one mma chain and
    accumulator per word position, added up at the end; the next step's words are loaded before this one is
    worked on); program (i, s) takes rows i·16·WARPS_N… and words s·CHUNK…; SPLIT as in `gemv_words_kernel`."""
    G: gl.constexpr = 8 * WARPS_N
    STEP: gl.constexpr = 4 * LANE_WORDS
    PLANES: gl.constexpr = 4 if WEIGHT == 2 else 2
    L3: gl.constexpr = gl.BlockedLayout([1, 1, LANE_WORDS], [8, 4, 1], [WARPS_N, 1, 1], [2, 1, 0])  # [g, q, word]
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, L2))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
    j = gl.arange(0, LANE_WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    first_row = gl.program_id(0) * (16 * WARPS_N) + (g // 8) * 16 + g % 8
    row = gl.expand_dims(first_row, 1) + gl.zeros([G, 4], gl.int32, L2)
    col = 2 * gl.expand_dims(q, 0) + gl.zeros([G, 4], gl.int32, L2)  # lane (g, q): rows g, g + 8 × inputs 2q, 2q + 1
    zero = gl.zeros([G, 4, LANE_WORDS], gl.int32, L3)
    rows = gl.expand_dims(row, 2) + zero  # the mma's rows g; its rows g + 8 are 8 further
    batch = gl.expand_dims(gl.expand_dims(g % 8, 1), 2) + zero  # the input row this lane gives the mma
    lane_words = gl.expand_dims(gl.expand_dims(LANE_WORDS * q, 0), 2) + gl.expand_dims(gl.expand_dims(j, 0), 1) + zero
    start = gl.program_id(1) * CHUNK
    stop = gl.minimum(start + CHUNK, WORDS)
    pairs_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + batch * (PLANES * WORDS)
    w_rows = w_ptr + rows.to(gl.int64) * WORDS
    first_ok, second_ok = rows < N, rows + 8 < N
    d0 = gl.zeros([G, 4, LANE_WORDS], gl.float32, L3)
    d1, d2, d3 = d0, d0, d0
    cw = start + lane_words
    first = gl.load(w_rows + cw, mask=(cw < stop) & first_ok, other=0)
    second = gl.load(w_rows + 8 * WORDS + cw, mask=(cw < stop) & second_ok, other=0)
    _start(PDL)  # weights are in flight; the input comes from the kernel before
    for c0 in range(start, stop, STEP):
        cw = c0 + lane_words
        ahead = cw + STEP
        first_next = gl.load(w_rows + ahead, mask=(ahead < stop) & first_ok, other=0)
        second_next = gl.load(w_rows + 8 * WORDS + ahead, mask=(ahead < stop) & second_ok, other=0)
        x_ok = (cw < stop) & (batch < M)
        p0 = _mma_pairs(pairs_ptr, cw, x_ok, WEIGHT, X_BF16)
        p1 = _mma_pairs(pairs_ptr, WORDS + cw, x_ok, WEIGHT, X_BF16)
        if WEIGHT == 2:
            p2 = _mma_pairs(pairs_ptr, 2 * WORDS + cw, x_ok, WEIGHT, X_BF16)
            p3 = _mma_pairs(pairs_ptr, 3 * WORDS + cw, x_ok, WEIGHT, X_BF16)
            d0, d1, d2, d3 = gl.inline_asm_elementwise(
                INT4_MMA_BF16 if X_BF16 else INT4_MMA_F16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                [first, second, p0, p1, p2, p3, d0, d1, d2, d3], dtype=_F32X4, is_pure=True, pack=1)
        else:
            d0, d1, d2, d3 = gl.inline_asm_elementwise(
                INT8_MMA, "=f,=f,=f,=f,r,r,r,r,f,f,f,f", [first, second, p0, p1, d0, d1, d2, d3], dtype=_F32X4,
                is_pure=True, pack=1)
        first, second = first_next, second_next
    d0, d1, d2, d3 = gl.sum(d0, axis=2), gl.sum(d1, axis=2), gl.sum(d2, axis=2), gl.sum(d3, axis=2)
    if SPLIT:
        base = gl.program_id(1) * M
        _store_partial(d0, partial_ptr, base, row, col, M, N)
        _store_partial(d1, partial_ptr, base, row, col + 1, M, N)
        _store_partial(d2, partial_ptr, base, row + 8, col, M, N)
        _store_partial(d3, partial_ptr, base, row + 8, col + 1, M, N)
        if _arrived_last(arrived_ptr, WARPS_N):
            d0 = _sum_partials(d0, partial_ptr, row, col, M, N)
            d1 = _sum_partials(d1, partial_ptr, row, col + 1, M, N)
            d2 = _sum_partials(d2, partial_ptr, row + 8, col, M, N)
            d3 = _sum_partials(d3, partial_ptr, row + 8, col + 1, M, N)
            _store_mma(d0, d1, d2, d3, row, col, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)
    else:
        _store_mma(d0, d1, d2, d3, row, col, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)


@gluon.jit
def _store_partial(d, partial_ptr, base, r, b, M, N):
    """partial_ptr[split, b, r] ← d, `base` = split · M."""
    gl.store(partial_ptr + (base + b) * N + r, d, mask=(r < N) & (b < M))


@gluon.jit
def _arrived_last(arrived_ptr, WARPS: gl.constexpr):
    """After this program stored its partial sums: count it in arrived_ptr[row block]; True for the last program of
    its row block, which then sees every program's sums and has reset the count to 0 for the next launch."""
    _fence(WARPS)  # each thread's partial sums visible GPU-wide before the count that announces them
    gl.thread_barrier()
    arrived = gl.atomic_add(arrived_ptr + gl.program_id(0), 1, sem="acq_rel", scope="gpu")
    last = arrived == gl.num_programs(1) - 1
    if last:
        _fence(WARPS)
        gl.store(arrived_ptr + gl.program_id(0), 0)
    return last


@gluon.jit
def _sum_partials(like, partial_ptr, r, b, M, N):
    """The sum over splits of partial_ptr[split, b, r] (from L2: other programs wrote them)."""
    total = gl.zeros_like(like)
    for split in range(gl.num_programs(1)):
        total += gl.load(partial_ptr + (split * M + b) * N + r, mask=(r < N) & (b < M), other=0.0,
                         cache_modifier=".cg")
    return total


@gluon.jit
def _store_mma(d0, d1, d2, d3, row, col, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT: gl.constexpr,
               HAS_BIAS: gl.constexpr):
    """y[col + (0, 1), row] ← d0, d1 and y[col + (0, 1), row + 8] ← d2, d3, scaled, plus bias."""
    _store_one(d0, row, col, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)
    _store_one(d1, row, col + 1, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)
    _store_one(d2, row + 8, col, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)
    _store_one(d3, row + 8, col + 1, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT, HAS_BIAS)


@gluon.jit
def _store_one(d, r, b, M, N, scale_ptr, bias_ptr, y_ptr, WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr):
    ok = (r < N) & (b < M)
    y = d * gl.load(scale_ptr + r, mask=ok, other=0.0)
    if WEIGHT == 1:
        y = y / WORD_INPUT_SCALE
    if HAS_BIAS:
        y += gl.load(bias_ptr + r, mask=ok, other=0.0).to(gl.float32)
    gl.store(y_ptr + b * N + r, y.to(y_ptr.dtype.element_ty), mask=ok)


MAX_SPLITS = 16
_PARTIAL_FLOATS = MAX_SPLITS * 65536
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device, never reallocated (CUDA graphs keep its addresses): float32 partial sums and zeroed counters.
    Split matmuls on one device must therefore run one at a time (one stream: each waits for the one before)."""
    if device not in _workspaces:
        _workspaces[device] = (torch.empty(_PARTIAL_FLOATS, dtype=torch.float32, device=device),
                               torch.zeros(_PARTIAL_FLOATS // MAX_SPLITS, dtype=torch.int32, device=device))
    return _workspaces[device]


def gemv_words(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               swiglu: bool, rows: int, vec: int, warps_n: int, warps_w: int, prefetch: bool, splits: int = 1,
               **launch) -> None:
    """y[0] = x[0] · Ŵᵀ (+ bias) for a bf16/fp16 row x (`[1, K]`, or `[1, 2K]` [up; gate] with swiglu) and INT8
    words; the words of each row are cut into `splits` runs that programs of their own reduce (fewer where
    N · splits would not fit the workspace). `launch`: kernels.pdl's options."""
    n, count = words.shape
    block_n, block_w = rows * warps_n, vec * 32 * warps_w
    splits = min(splits, MAX_SPLITS, max(1, _PARTIAL_FLOATS // n))
    chunk = triton.cdiv(triton.cdiv(count, splits), block_w) * block_w
    splits = triton.cdiv(count, chunk)
    partial, arrived = _workspace(x.device)
    gemv_words_kernel[(triton.cdiv(n, block_n), splits)](
        x, words, scale, bias if bias is not None else scale, y, partial, arrived, n, count, chunk,
        X_BF16=x.dtype == torch.bfloat16, SWIGLU=swiglu, HAS_BIAS=bias is not None, ROWS=rows, VEC=vec,
        WARPS_N=warps_n, WARPS_W=warps_w, PREFETCH=prefetch, SPLIT=splits > 1, num_warps=warps_n * warps_w, **launch)


def gemv_pairs(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               rows: int, vec: int, warps_n: int, warps_w: int, **launch) -> None:
    """y[0] = x[0] · Ŵᵀ (+ bias) for a bf16/fp16 row x `[1, K]` and INT4 words (`gemv_pairs_kernel`). Inputs are
    converted to half precision unscaled: |x| must stay below 16,384 (a partial sum of 16 products may reach
    4 · |x|)."""
    n, count = words.shape
    block_n = rows * warps_n
    gemv_pairs_kernel[(triton.cdiv(n, block_n),)](
        x, words, scale, bias if bias is not None else scale, y, n, count, X_BF16=x.dtype == torch.bfloat16,
        HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, ROWS=rows, VEC=vec, WARPS_N=warps_n, WARPS_W=warps_w,
        num_warps=warps_n * warps_w, **launch)


def gemv_mma(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
             weight: int, warps_n: int, lane_words: int = 4, splits: int = 1, **launch) -> None:
    """y = x · Ŵᵀ (+ bias) for 1 to 8 bf16/fp16 rows x `[M, K]` on tensor cores (`gemv_mma_kernel`)."""
    (m, _), (n, count) = x.shape, words.shape
    splits = min(splits, MAX_SPLITS, max(1, _PARTIAL_FLOATS // (m * n)))
    chunk = triton.cdiv(triton.cdiv(count, splits), 4 * lane_words) * 4 * lane_words
    splits = triton.cdiv(count, chunk)
    partial, arrived = _workspace(x.device)
    gemv_mma_kernel[(triton.cdiv(n, 16 * warps_n), splits)](
        x, words, scale, bias if bias is not None else scale, y, partial, arrived, m, n, count, chunk, WEIGHT=weight,
        X_BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, WARPS_N=warps_n, LANE_WORDS=lane_words,
        SPLIT=splits > 1, num_warps=warps_n, **launch)
