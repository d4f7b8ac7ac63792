"""Triton kernels of the fast runtime: the fused steps between the matmuls, decode attention, the matmuls.

Each step kernel has a torch twin in `ops.TorchOps` that defines what it computes, and the
matmuls compute x · (stored weights × per-row scale)ᵀ as linear.py's dequantized weights do;
tests compare them (under Triton's interpreter on the CPU, natively on a GPU). Shapes follow the fast
model: activations are `[tokens, features]` row-major, the KV cache of one layer is paged:
`[blocks, kv_heads, block_size, head_size]`, position p of a slot in block `table[slot, p // block_size]`
(runtime/cache.py, `PagedCache`).

Decode attention is split-K ("flash decoding"): every (sequence, KV head, chunk of
`CHUNK` positions) is one program, which puts the `GROUP` query heads sharing that KV head
in one `[GROUP, head]` tile so the tensor cores do the dot products. A sequence within one
chunk is written out by that chunk's program; otherwise the last of its chunks' programs to
finish (an atomic count) merges them through their log-sum-exp, so no second kernel is
launched. Chunks past a sequence's end exit at once, so one launch shape (fixed by the cache
length) serves every length, as CUDA graphs need. A step of one sequence instead runs
`rope_attention`: one program per (query head, chunk), which also rotates q and k and writes
the new key and value into the cache, and loads the older keys before it waits for `qkv`: one
launch fewer on the path through a layer and 32 programs instead of 2, which pays where the
step is a chain of latencies (batch 1) and not where many sequences fill the GPU. Its dot
products also run on tensor cores (the one query padded to 16 rows): on CUDA cores the float32
products of a 256-position tile spilled registers and the step took 0.012 ms longer. Every dot product takes
float32 inputs as they are (`input_precision="ieee"`, not tf32's 10-bit mantissas): a float32 model (the tests')
computes in float32 throughout; 16-bit inputs are unaffected.

The matmuls: for decoding one sequence, a one-row kernel for float weights (products summed
elementwise and reduced once; memory-bound) and one for int8/int4 weights stored as planar
words (below; on the GPU the Gluon kernel of gluon_gemv.py, whose layout is explicit); for
several rows, tensor-core kernels for float and for int8/int4 words. Block shapes are chosen
per (weight kind, row bucket, shape) by timing the candidates at start-up (`tune`, CUDA-graph
replays on a cold L2 cache), cuBLAS included for float weights.

FP8 (an FP8 checkpoint's, linear.py): `quantize_fp8` turns a matmul's input rows (or SwiGLU of them) into FP8 at the
layer's static scale, for torch._scaled_mm; an FP8 KV cache (float8_e4m3fn, one scale per layer) is written by
`rope_cache` and `rope_attention` at that scale, saturated, and read by both attention kernels as values of the
compute dtype, the keys' scale folded into the softmax scale and the values' into each chunk's products.

On Hopper and later every kernel here is launched with programmatic dependent launch (`pdl`): it
may start while the kernel before it finishes, and the matmuls start reading their weights before
they wait for that kernel's results (`_start`), which hides most of the gap between kernels.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

from trtglm.runtime.fast.shapes import DECODE_CHUNK, row_bucket

if importlib.util.find_spec("triton.experimental.gluon"):  # Gluon (Triton with explicit layouts): Triton 3.5 on
    from trtglm.runtime.fast import gluon_gemv
else:
    gluon_gemv = None

ROPE_ATTENTION_CHUNK = 256  # positions per program of the one-head decode attention (rope_attention)
ROPE_ATTENTION_BATCH = 1  # decode steps of at most this many sequences use rope_attention
PDL_ENABLED = True  # programmatic dependent launch on GPUs that have it (Hopper on): see `pdl`
ARRIVAL_COUNTERS = 1 << 16  # decode attention: sequences × KV heads per launch, at most
L2_FLUSH_BYTES = 128 << 20  # more than any GPU's L2 cache (H100/H200: 50 MB)


def pdl(device: torch.device) -> dict:
    """Launch options for programmatic dependent launch: a kernel may start (and read its weights) while the one
    before it finishes, and waits (`_start`) before it touches that kernel's results. Needs a Hopper GPU or later
    and a real one (not Triton's interpreter)."""
    on = PDL_ENABLED and device.type == "cuda" and _has_pdl(device.index)
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def _has_pdl(index: int | None) -> bool:
    return not triton.knobs.runtime.interpret and torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def _start(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous kernel is done and its writes are visible (the
    first global access to anything but weights must come after this), then let the next kernel launch (only one
    kernel ahead waits on the GPU at a time)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _decode_inputs_kernel(token_ptr, slot_ptr, seq_len_ptr, embedding_ptr, x_ptr, pos_ptr, scratch, hidden,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    _start(PDL)
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b)
    pos = tl.load(seq_len_ptr + slot)
    tl.store(pos_ptr + b, pos)
    if slot != scratch:  # a sequence's slot appears once in a step; the scratch slot's length stays 0
        tl.store(seq_len_ptr + slot, pos + 1)
    token = tl.load(token_ptr + b).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row = tl.load(embedding_ptr + token * hidden + cols, mask=cols < hidden)
    tl.store(x_ptr + b.to(tl.int64) * hidden + cols, row, mask=cols < hidden)


def decode_inputs(tokens: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, embedding: torch.Tensor,
                  scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding rows of `tokens`, each slot's position) of a decode step, and each slot's length advanced."""
    batch, hidden = tokens.shape[0], embedding.shape[1]
    x = torch.empty(batch, hidden, dtype=embedding.dtype, device=embedding.device)
    positions = torch.empty(batch, dtype=seq_len.dtype, device=seq_len.device)
    _decode_inputs_kernel[(batch,)](tokens, slots, seq_len, embedding, x, positions, scratch, hidden,
                                    BLOCK=triton.next_power_of_2(hidden), num_warps=4, **pdl(embedding.device))
    return x, positions


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """With a delta, only the delta comes from the kernel just before; x (the residual stream) was written earlier.
    So x and the norm weight are read before waiting for that kernel (`_start`): a kernel starts only after the one
    before it has waited for its own predecessor, so everything older is complete."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        _start(PDL)
        delta = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    else:
        _start(PDL)
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) · weight) for `[T, H]` rows; no delta: (x, RMSNorm(x) · weight)."""
    rows, cols = x.shape
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, total, out, cols, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(4, block // 512)),
                                  **pdl(x.device))
    return total, out


@triton.jit
def _rotary(src, d, cos, sin):
    """GPT-J rotary of one head (`d` = 0..D-1; cos 1 and sin 0 past the rotated features), float32."""
    x = tl.load(src + d).to(tl.float32)
    partner = tl.load(src + (d ^ 1)).to(tl.float32)  # the other element of the (even, odd) pair
    return x * cos + tl.where(d % 2 == 0, -partner, partner) * sin


@triton.jit
def _to_cache(x, kv_scale, COMPUTE: tl.constexpr, CACHE: tl.constexpr, FP8_KV: tl.constexpr):
    """A key or value as the cache keeps it: in the compute dtype, or (an FP8 cache) that value / kv_scale in FP8,
    saturated at ±448 (conventions.FP8_MAX), as quant.to_fp8."""
    x = x.to(COMPUTE)
    if FP8_KV:
        x = tl.clamp(tl.div_rn(x.to(tl.float32), kv_scale), -448.0, 448.0)
    return x.to(CACHE)


@triton.jit
def _rope_cache_kernel(qkv_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, table_ptr, qkv_stride,
                       block_stride, head_stride, table_stride, kv_scale, H: tl.constexpr, KVH: tl.constexpr,
                       D: tl.constexpr, ROT: tl.constexpr, BS: tl.constexpr, FP8_KV: tl.constexpr, PDL: tl.constexpr):
    _start(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1 query, H..H+KVH-1 key, then value
    d = tl.arange(0, D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    src = qkv_ptr + t * qkv_stride + head * D
    line = tl.load(table_ptr + slot * table_stride + pos // BS).to(tl.int64) * block_stride + (pos % BS) * D + d
    if head < H + KVH:
        rotated = d < ROT
        cos = tl.load(cos_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=1.0)
        sin = tl.load(sin_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=0.0)
        y = _rotary(src, d, cos, sin)
        if head < H:
            tl.store(q_ptr + (t * H + head) * D + d, y.to(q_ptr.dtype.element_ty))
        else:
            tl.store(k_ptr + line + (head - H) * head_stride,
                     _to_cache(y, kv_scale, q_ptr.dtype.element_ty, k_ptr.dtype.element_ty, FP8_KV))
    else:
        tl.store(v_ptr + line + (head - H - KVH) * head_stride,
                 _to_cache(tl.load(src + d), kv_scale, q_ptr.dtype.element_ty, v_ptr.dtype.element_ty, FP8_KV))


def rope_cache(qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, num_heads: int,
               kv_scale: float = 1.0) -> torch.Tensor:
    """Rotate q and k of `qkv` `[T, (H + 2·KVH)·D]`, store k/v at (slot, position) of the paged cache (`table`:
    each slot's blocks; an FP8 cache keeps them at `kv_scale`); q `[T, H, D]`."""
    tokens = qkv.shape[0]
    kv_heads, head = k_cache.shape[1], k_cache.shape[3]
    q = torch.empty(tokens, num_heads, head, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(tokens, num_heads + 2 * kv_heads)](
        qkv, slots, positions, cos, sin, q, k_cache, v_cache, table, qkv.stride(0), k_cache.stride(0),
        k_cache.stride(1), table.stride(0), kv_scale, H=num_heads, KVH=kv_heads, D=head, ROT=2 * cos.shape[1],
        BS=k_cache.shape[2], FP8_KV=_fp8(k_cache), num_warps=1, **pdl(qkv.device))
    return q


def _fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, pos_ptr, o_ptr, lse_ptr, out_ptr, arrived_ptr,
                             scale, kv_scale, block_stride, head_stride, table_stride, H: tl.constexpr,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr, FP8_KV: tl.constexpr,
                             PDL: tl.constexpr):
    """`scale` includes an FP8 cache's kv_scale (its keys' scale); its values' is applied to each product."""
    _start(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + b)
    used = pos // CHUNK + 1  # chunks holding positions 0..pos; the programs of the others have nothing to do
    if split < used:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        end = tl.minimum(split * CHUNK + CHUNK, pos + 1)
        g = tl.arange(0, GROUP_PAD)  # query heads of this KV head, padded to a tensor-core tile
        head_ok = g < GROUP
        d = tl.arange(0, D)
        heads = b * H + kv_head * GROUP + g
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
        table = table_ptr + slot * table_stride
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(split * CHUNK, end, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            valid = idx < end
            cached = _paged_rows(table, idx, valid, block_stride, kv_head * head_stride, BS, D)[:, None] + d[None, :]
            k = tl.load(k_ptr + cached, mask=valid[:, None], other=0.0).to(q.dtype)
            scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + cached, mask=valid[:, None], other=0.0).to(q.dtype)
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            if FP8_KV:
                pv = pv * kv_scale
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = out_ptr + heads[:, None] * D + d[None, :]
        if used == 1:
            tl.store(out, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        else:
            rows = heads * SPLITS
            tl.store(o_ptr + (rows + split)[:, None] * D + d[None, :], acc / total[:, None], mask=head_ok[:, None])
            tl.store(lse_ptr + rows + split, m + tl.log(total), mask=head_ok)
            tl.debug_barrier()  # every thread's partials stored before the count that announces them
            counter = arrived_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(counter, 0)  # the last to arrive: reset for the next launch, merge every chunk's part
                _merge_chunks(o_ptr, lse_ptr, rows, used, head_ok, d, out, GROUP_PAD, D)


@triton.jit
def _paged_rows(table, idx, valid, block_stride, head_offset, BS: tl.constexpr, D: tl.constexpr):
    """Where positions `idx` of a slot (its row of the block table at `table`) start in one KV head's cache."""
    blocks = tl.load(table + idx // BS, mask=valid, other=0).to(tl.int64)
    return blocks * block_stride + head_offset + (idx % BS) * D


@triton.jit
def _merge_chunks(o_ptr, lse_ptr, rows, used, head_ok, d, out, GROUP_PAD: tl.constexpr, D: tl.constexpr):
    """out ← the chunks' attention outputs weighted by their softmax mass (from L2: other programs wrote them)."""
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s in range(used):
        top = tl.maximum(top, tl.load(lse_ptr + rows + s, mask=head_ok, other=0.0, cache_modifier=".cg"))
    mass = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for s in range(used):
        weight = tl.exp(tl.load(lse_ptr + rows + s, mask=head_ok, other=0.0, cache_modifier=".cg") - top)
        part = tl.load(o_ptr + (rows + s)[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0,
                       cache_modifier=".cg")
        acc += weight[:, None] * part
        mass += weight
    tl.store(out, (acc / mass[:, None]).to(out.dtype.element_ty), mask=head_ok[:, None])


_arrival_counters: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters (one per sequence × KV head) that each decode-attention launch leaves zeroed; never
    reallocated, since CUDA graphs keep their address. Launches on one device must therefore run one at a time (one
    stream: each waits for the one before)."""
    if device not in _arrival_counters:
        _arrival_counters[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    if count > ARRIVAL_COUNTERS:
        raise ValueError(f"decode attention takes at most {ARRIVAL_COUNTERS} sequences × KV heads, not {count}")
    return _arrival_counters[device]


def decode_block(batch: int) -> int:
    """Positions per inner step of decode attention: few sequences (few programs) take longer steps, so fewer of
    them, each waiting on memory; many take shorter ones, which let more programs share an SM."""
    return 128 if batch <= 16 else 64


def _split_outputs(batch: int, num_heads: int, k_cache: torch.Tensor, table: torch.Tensor, chunk: int,
                   dtype: torch.dtype, length: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunks of `length` positions (None: a slot's most), each chunk's float32 output and log-sum-exp per head, the
    output `[B, H·D]`) for a split-K decode attention launch."""
    head, max_len = k_cache.shape[3], table.shape[1] * k_cache.shape[2]
    splits = triton.next_power_of_2(triton.cdiv(length or max_len, chunk))
    parts = torch.empty(batch, num_heads, splits, head, dtype=torch.float32, device=k_cache.device)
    lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=k_cache.device)
    return splits, parts, lse, torch.empty(batch, num_heads * head, dtype=dtype, device=k_cache.device)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, length: int | None = None,
                     kv_scale: float = 1.0) -> torch.Tensor:
    """One query per sequence `q` `[B, H, D]` over cache positions 0..position of its slot; `[B, H·D]`. `length`:
    no position reaches it (None: a slot's most), so fewer partial outputs are kept; `kv_scale`: an FP8 cache's."""
    batch, num_heads, head = q.shape
    kv_heads = k_cache.shape[1]
    splits, parts, lse, out = _split_outputs(batch, num_heads, k_cache, table, DECODE_CHUNK, q.dtype, length)
    _decode_attention_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, table, slots, positions, parts, lse, out, _arrivals(q.device, batch * kv_heads),
        head ** -0.5 * kv_scale, kv_scale, k_cache.stride(0), k_cache.stride(1), table.stride(0), H=num_heads,
        GROUP=num_heads // kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_heads // kv_heads)), D=head,
        CHUNK=DECODE_CHUNK, BLOCK=decode_block(batch), SPLITS=splits, BS=k_cache.shape[2], FP8_KV=_fp8(k_cache),
        num_warps=4, num_stages=2, **pdl(q.device))
    return out


@triton.jit
def _rope_attention_kernel(qkv_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, table_ptr, o_ptr, lse_ptr,
                           out_ptr, arrived_ptr, scale, kv_scale, qkv_stride, block_stride, head_stride, table_stride,
                           H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, CHUNK: tl.constexpr,
                           SPLITS: tl.constexpr, BS: tl.constexpr, LINE: tl.constexpr, FP8_KV: tl.constexpr,
                           PDL: tl.constexpr):
    """rope_cache and decode attention of one query head over one chunk of positions. Before waiting for `qkv`, the
    keys of earlier steps are loaded and their values fetched into L2 (registers would not hold both; LINE > 0:
    values per 128-byte line). The new key and value come from `qkv` itself (the first query head of each KV head
    stores them in the cache, as the cache keeps them: an FP8 cache's, the products of which take kv_scale, which
    `scale` includes for the keys)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    group = H // KVH
    kv_head = h // group
    pos = tl.load(pos_ptr + b)
    used = pos // CHUNK + 1
    if split < used:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        idx = split * CHUNK + tl.arange(0, CHUNK)
        d = tl.arange(0, D)
        table = table_ptr + slot * table_stride
        kv_rows = _paged_rows(table, idx, idx <= pos, block_stride, kv_head * head_stride, BS, D)
        cached = kv_rows[:, None] + d[None, :]
        older = (idx < pos)[:, None]  # written by earlier steps, complete before this kernel starts
        k = tl.load(k_ptr + cached, mask=older, other=0.0)
        if LINE > 0:  # one address per line
            lines = v_ptr + kv_rows[:, None] + (tl.arange(0, D // LINE) * LINE)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                      is_pure=False, pack=1)
        rotated = d < ROT
        cos = tl.load(cos_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=1.0)
        sin = tl.load(sin_ptr + pos * (ROT // 2) + d // 2, mask=rotated, other=0.0)
        _start(PDL)
        v = tl.load(v_ptr + cached, mask=older, other=0.0)
        row = qkv_ptr + b * qkv_stride
        q = _rotary(row + h * D, d, cos, sin).to(qkv_ptr.dtype.element_ty)
        k_new = _to_cache(_rotary(row + (H + kv_head) * D, d, cos, sin), kv_scale, qkv_ptr.dtype.element_ty,
                          k_ptr.dtype.element_ty, FP8_KV)
        v_new = _to_cache(tl.load(row + (H + KVH + kv_head) * D + d), kv_scale, qkv_ptr.dtype.element_ty,
                          v_ptr.dtype.element_ty, FP8_KV)
        stores = (d < D) & (h % group == 0) & (split == used - 1)
        newest_row = tl.load(table + pos // BS).to(tl.int64) * block_stride + kv_head * head_stride + (pos % BS) * D
        tl.store(k_ptr + newest_row + d, k_new, mask=stores)
        tl.store(v_ptr + newest_row + d, v_new, mask=stores)
        newest = (idx == pos)[:, None]
        # an FP8 cache's values are read as values of the compute dtype (qkv's)
        k = tl.where(newest, k_new.to(qkv_ptr.dtype.element_ty)[None, :], k.to(qkv_ptr.dtype.element_ty))
        v = tl.where(newest, v_new.to(qkv_ptr.dtype.element_ty)[None, :], v.to(qkv_ptr.dtype.element_ty))
        # The dot products on tensor cores, this head's query as row 0 of a 16-row tile (the others zero).
        first = tl.arange(0, 16) == 0
        query = tl.where(first[:, None], q.to(k.dtype)[None, :], 0.0)
        scores = tl.dot(query, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where((idx <= pos)[None, :], scores, float("-inf"))
        top = tl.max(scores, axis=1)
        p = tl.exp(scores - top[:, None])
        acc = tl.sum(tl.where(first[:, None], tl.dot(p.to(v.dtype), v, input_precision="ieee"), 0.0), axis=0)
        if FP8_KV:
            acc = acc * kv_scale
        total = tl.sum(tl.where(first, tl.sum(p, axis=1), 0.0), axis=0)
        top = tl.sum(tl.where(first, top, 0.0), axis=0)
        head = b * H + h
        if used == 1:
            tl.store(out_ptr + head * D + d, (acc / total).to(out_ptr.dtype.element_ty))
        else:
            one = tl.arange(0, 1)  # the merge takes tiles of heads: a tile of one
            rows = head * SPLITS + one
            tl.store(o_ptr + (head * SPLITS + split) * D + d, acc / total)
            tl.store(lse_ptr + rows + split, tl.zeros([1], tl.float32) + top + tl.log(total))
            tl.debug_barrier()  # every thread's partials stored before the count that announces them
            counter = arrived_ptr + head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(counter, 0)
                _merge_chunks(o_ptr, lse_ptr, rows, used, one < 1, d, out_ptr + (head + one[:, None]) * D + d[None, :],
                              1, D)


def rope_attention(qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, num_heads: int,
                   kv_scale: float = 1.0) -> torch.Tensor:
    """rope_cache then decode_attention in one launch, one program per (sequence, query head, chunk): every key and
    value is read once per query head, which pays where few sequences leave most SMs idle."""
    batch = qkv.shape[0]
    _, kv_heads, _, head = k_cache.shape
    splits, parts, lse, out = _split_outputs(batch, num_heads, k_cache, table, ROPE_ATTENTION_CHUNK, qkv.dtype)
    _rope_attention_kernel[(batch, num_heads, splits)](
        qkv, slots, positions, cos, sin, k_cache, v_cache, table, parts, lse, out,
        _arrivals(qkv.device, batch * num_heads), head ** -0.5 * kv_scale, kv_scale, qkv.stride(0), k_cache.stride(0),
        k_cache.stride(1), table.stride(0), H=num_heads, KVH=kv_heads, D=head, ROT=2 * cos.shape[1],
        CHUNK=ROPE_ATTENTION_CHUNK, SPLITS=splits, BS=k_cache.shape[2], LINE=_prefetch_line(v_cache),
        FP8_KV=_fp8(k_cache), num_warps=8, **pdl(qkv.device))
    return out


def _prefetch_line(cache: torch.Tensor) -> int:
    """Elements per 128-byte line of the cache where a kernel may prefetch its rows into L2 line by line, else 0."""
    line = 128 // cache.element_size()
    return line if not triton.knobs.runtime.interpret and cache.shape[-1] % line == 0 else 0


def decode_qkv_attention(qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         num_heads: int, kv_scale: float = 1.0) -> torch.Tensor:
    """Decode attention from the qkv rows: `rope_attention` for up to ROPE_ATTENTION_BATCH sequences, else
    `rope_cache` and `decode_attention`."""
    if qkv.shape[0] <= ROPE_ATTENTION_BATCH:
        return rope_attention(qkv, slots, positions, cos, sin, k_cache, v_cache, table, num_heads, kv_scale)
    q = rope_cache(qkv, slots, positions, cos, sin, k_cache, v_cache, table, num_heads, kv_scale)
    return decode_attention(q, k_cache, v_cache, table, slots, positions, kv_scale=kv_scale)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _start(PDL)
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
    _silu_mul_kernel[(tokens, triton.cdiv(inner, block))](x, out, inner, BLOCK=block, num_warps=4, **pdl(x.device))
    return out


@triton.jit
def _quantize_fp8_kernel(x_ptr, scale_ptr, out_ptr, F, x_stride, SWIGLU: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    scale = tl.load(scale_ptr)
    _start(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < F
    x = tl.load(x_ptr + t * x_stride + i, mask=mask, other=0.0)
    if SWIGLU:  # x holds [up; gate]: silu(gate) · up, rounded to the compute dtype as silu_mul's output is
        gate = tl.load(x_ptr + t * x_stride + F + i, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * x.to(tl.float32)).to(x_ptr.dtype.element_ty)
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)  # IEEE division, as torch's; FP8_MAX
    tl.store(out_ptr + t * F + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """`[T, F]` rows as float8_e4m3fn at `scale` (a float32 scalar on the device): x / scale saturated at ±448, as
    quant.to_fp8; `swiglu`: `[T, 2F]` rows holding [up; gate], quantized silu(gate) · up."""
    tokens, width = x.shape
    inner = width // 2 if swiglu else width
    out = torch.empty(tokens, inner, dtype=torch.float8_e4m3fn, device=x.device)
    block = 1024
    _quantize_fp8_kernel[(tokens, triton.cdiv(inner, block))](x, scale, out, inner, x.stride(0), SWIGLU=swiglu,
                                                              BLOCK=block, num_warps=4, **pdl(x.device))
    return out


# --- weight-only matmuls ------------------------------------------------------------------------------------------
# Weight storage kinds: FLOAT ([N, K] in the compute dtype) and, with a float32 scale per row, INT8 and INT4 as rows
# of 32-bit words in a planar order. The input row is read as pairs of features (2i, 2i + 1) and the pairs as planes,
# runs of WORDS pairs each (INT8: 2 planes, WORDS = K/4; INT4: 4 planes, WORDS = K/8); word c of a weight row holds,
# for every plane p, the two weights of pair p·WORDS + c (stored as value + 128 or value + 8):
#   INT8: bytes 0, 1 ← plane 0, bytes 2, 3 ← plane 1 (the weight of feature 2i + h at bits 16p + 8h);
#   INT4: the nibbles at bits 4p and 16 + 4p ← plane p (feature 2i + h at bits 4p + 16h).
# So each plane of the input is one contiguous run, which a kernel reads with one vector load and reuses for every
# row it holds, and one `prmt` (INT8) or `lop3` (INT4) turns a word's pair into two half-precision values that meet
# their input pair as it lies in memory.
FLOAT, INT8, INT4 = 0, 1, 2


@triton.jit
def _plane_weights(w, p: tl.constexpr, h: tl.constexpr, WEIGHT: tl.constexpr):
    """The int32 weight values of feature 2i + h of plane p's pairs in words `w` (INT8 or INT4)."""
    if WEIGHT == 2:
        values = ((w >> (4 * p + 16 * h)) & 15) - 8
    else:
        values = ((w >> (16 * p + 8 * h)) & 255) - 128
    return values


@triton.jit
def _plane_pairs(w, p: tl.constexpr, WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Plane p's weight pairs of the words `w` `[BLOCK_N, BLOCK_W]`, interleaved back into feature order:
    `[BLOCK_N, 2·BLOCK_W]` int32 values."""
    return tl.reshape(tl.join(_plane_weights(w, p, 0, WEIGHT), _plane_weights(w, p, 1, WEIGHT)), (BLOCK_N, 2 * BLOCK_W))


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[M, N] = x[M, K] · Wᵀ for FLOAT weights (tensor cores, several rows)."""
    _start(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    _store_tile(acc, rm, rn, m_ok, n_ok, bias_ptr, y_ptr, N, HAS_BIAS)


@triton.jit
def _store_tile(acc, rm, rn, m_ok, n_ok, bias_ptr, y_ptr, N, HAS_BIAS: tl.constexpr):
    """y[rm, rn] ← acc (+ bias), for the tensor-core kernels."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _matmul_words_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, WORDS, WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                         PDL: tl.constexpr):
    """y[M, N] = x · Ŵᵀ for planar INT8/INT4 words (tensor cores, several rows): each plane's weight pairs are
    interleaved back into feature order and meet one contiguous tile of the input."""
    _start(PDL)
    PLANES: tl.constexpr = 4 if WEIGHT == 2 else 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, BLOCK_W)
    rf = tl.arange(0, 2 * BLOCK_W)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * (2 * PLANES * WORDS)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * WORDS
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c0 in range(0, WORDS, BLOCK_W):
        w = tl.load(w_rows + (c0 + rw)[None, :], mask=n_ok[:, None] & (c0 + rw < WORDS)[None, :], other=0)
        f_ok = rf < 2 * (WORDS - c0)
        for p in tl.static_range(PLANES):
            x = tl.load(x_rows + (2 * (p * WORDS + c0) + rf)[None, :], mask=m_ok[:, None] & f_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(_plane_pairs(w, p, WEIGHT, BLOCK_N, BLOCK_W).to(x.dtype)), input_precision="ieee")
    acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    _store_tile(acc, rm, rn, m_ok, n_ok, bias_ptr, y_ptr, N, HAS_BIAS)


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
def _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Store the row sums of `acc` × scale + bias at rows rn."""
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y[N] = x[K_in] · Wᵀ for one row and FLOAT weights: products accumulate elementwise, one reduction at the end.
    The first tile of weights is loaded before waiting for the kernel before (the rest are pipelined by Triton)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    first = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    _start(PDL)
    acc = first.to(tl.float32) * _gemv_input(x_ptr, rk, rk < K, K, SWIGLU)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * _gemv_input(x_ptr, kk, k_ok, K, SWIGLU)[None, :]
    _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, False, HAS_BIAS)


@triton.jit
def _gemv_words_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, WORDS, WEIGHT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    """y[N] = x · Ŵᵀ for one row of planar INT8/INT4 words, in float32 (Triton's interpreter, float32 inputs; on the
    GPU gluon_gemv.py does this for 16-bit inputs)."""
    _start(PDL)
    PLANES: tl.constexpr = 4 if WEIGHT == 2 else 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * WORDS
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for c0 in range(0, WORDS, BLOCK_W):
        cw = c0 + rw
        c_ok = cw < WORDS
        w = tl.load(w_rows + cw[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0)
        for p in tl.static_range(PLANES):
            for h in tl.static_range(2):
                x = tl.load(x_ptr + 2 * (p * WORDS + cw) + h, mask=c_ok, other=0.0).to(tl.float32)
                acc += _plane_weights(w, p, h, WEIGHT).to(tl.float32) * x[None, :]
    _gemv_output(acc, rn, n_ok, scale_ptr, bias_ptr, y_ptr, True, HAS_BIAS)


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, out_ptr, N, WORDS, WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_W: tl.constexpr):
    """out `[N, K]` = Ŵ in feature order and out's dtype, from planar INT8/INT4 words."""
    PLANES: tl.constexpr = 4 if WEIGHT == 2 else 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rf = 2 * tl.program_id(1) * BLOCK_W + tl.arange(0, 2 * BLOCK_W)
    n_ok = rn < N
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * WORDS + rw[None, :], mask=n_ok[:, None] & (rw < WORDS)[None, :],
                other=0)
    scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[:, None]
    out_rows = out_ptr + rn.to(tl.int64)[:, None] * (2 * PLANES * WORDS)
    for p in tl.static_range(PLANES):
        values = _plane_pairs(w, p, WEIGHT, BLOCK_N, BLOCK_W).to(tl.float32) * scale
        tl.store(out_rows + (2 * p * WORDS + rf)[None, :], values.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & (rf < 2 * WORDS)[None, :])


_dequantized_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dequantize(words: torch.Tensor, scale: torch.Tensor, weight: int, dtype: torch.dtype) -> torch.Tensor:
    """Ŵ `[N, K]` in `dtype` from planar INT8/INT4 words `[N, WORDS]`, in a buffer per device and dtype that the
    next call overwrites (it grows to the largest weight seen; prompts then multiply with cuBLAS)."""
    (n, count), planes = words.shape, 4 if weight == INT4 else 2
    size = n * 2 * planes * count
    key = (words.device, dtype)
    if key not in _dequantized_buffers or _dequantized_buffers[key].numel() < size:
        _dequantized_buffers.pop(key, None)  # the smaller buffer's memory may serve the larger
        _dequantized_buffers[key] = torch.empty(size, dtype=dtype, device=words.device)
    out = _dequantized_buffers[key][:size].view(n, 2 * planes * count)
    block_n, block_w = 32, 64
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(count, block_w))](
        words, scale, out, n, count, WEIGHT=weight, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4)
    return out


def dequantize_buffers() -> list[torch.Tensor]:
    """The buffers `dequantize` writes into now (a CUDA graph holds on to those it was captured with)."""
    return list(_dequantized_buffers.values())


def graph_time_ms(fn, calls: int = 10, replays: int = 5) -> float:
    """Median time of one call of `fn` on a cold L2 cache, replayed from a CUDA graph as decode steps run
    (launching from Python would time the host, and repeating one call would read its weights from L2):
    a graph of `calls` × (overwrite L2_FLUSH_BYTES, fn) less a graph of the overwrites alone, replayed in
    alternation so that both see the same clocks; the median of the differences."""
    flush = _l2_flush_buffer()
    with_fn = _graph(lambda: (flush.zero_(), fn()), calls)
    alone = _graph(flush.zero_, calls)
    differences = [_replay_ms(with_fn) - _replay_ms(alone) for _ in range(replays)]
    return sorted(differences)[len(differences) // 2] / calls


def warm_graph_times_ms(fns: list, replays: int = 20, rounds: int = 5) -> list[float]:
    """Time of one call of each of `fns` as a CUDA graph of that call replayed `replays` times back to back (L2 as
    the calls leave it); the graphs take turns for `rounds` rounds, so that all see the same clocks: each one's best
    round."""
    graphs = [_graph(fn, 1) for fn in fns]
    best = [float("inf")] * len(graphs)
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            best[i] = min(best[i], _replay_ms(graph, replays))
    return best


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")


def _graph(body, calls: int) -> torch.cuda.CUDAGraph:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Thread-local: a tensor-parallel rank tunes between collectives, whose events PyTorch's NCCL watchdog thread
    # polls meanwhile; only this thread's calls must be capture-safe.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            body()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, times: int = 1) -> float:
    """Milliseconds per replay of `graph`, replayed `times` times back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / times


def gluon_available(x: torch.Tensor) -> bool:
    """The Gluon kernels (gluon_gemv.py) take 16-bit inputs on a real GPU (not Triton's interpreter)."""
    return gluon_gemv is not None and not triton.knobs.runtime.interpret and x.is_cuda \
        and x.dtype in (torch.bfloat16, torch.float16)


class Config(NamedTuple):
    """Block shape of the Triton kernels: one-row (block_m 0), tensor-core (block_m > 0) or cuBLAS (CUBLAS; INT8/INT4
    weights are dequantized into a buffer first)."""
    block_m: int
    block_n: int
    block_k: int  # one-row kernels: stored columns (bytes) per step; tensor-core kernels: input features per step
    warps: int
    stages: int
    fuse_swiglu: bool = True  # the one-row kernel applies SwiGLU to its input (else a separate kernel does)


class GemvConfig(NamedTuple):
    """Layout of the one-row INT8 kernel (Gluon's `gemv_words_kernel`; INT8 and INT4 in the portable one): each thread
    holds `rows` rows × `vec` words; warps_n × warps_w warps; `prefetch`: load the next tile before working on this
    one; each row's words cut into `splits` runs (Gluon)."""
    rows: int
    vec: int
    warps_n: int
    warps_w: int
    prefetch: bool
    splits: int = 1
    fuse_swiglu: bool = True

    @property
    def block_n(self) -> int:
        return self.rows * self.warps_n

    @property
    def block_w(self) -> int:
        return self.vec * 32 * self.warps_w


class PairConfig(NamedTuple):
    """Layout of the one-row INT4 kernel (Gluon's `gemv_pairs_kernel`): each thread holds `rows` rows × `vec` words of
    each of a step's two half tiles; warps_n × warps_w warps."""
    rows: int
    vec: int
    warps_n: int
    warps_w: int


class MmaConfig(NamedTuple):
    """The tensor-core kernel for 1 to 8 rows and INT8/INT4 words (Gluon only): warps_n warps of 16 weight rows each,
    each lane taking `lane_words` words of two rows per step, each row's words cut into `splits` runs."""
    warps_n: int
    lane_words: int = 4
    splits: int = 1


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
# The one-row INT8 kernel (and the portable one for INT8/INT4): the layouts that were fastest for some 6B matrix on
# an H200 (bench_matmul, docs/benchmarks.md), and their neighbours.
GEMV_CANDIDATES = [GemvConfig(*shape) for shape in (
    (8, 2, 1, 4, True), (8, 2, 1, 4, False), (4, 4, 1, 4, True), (4, 4, 1, 4, False), (4, 4, 4, 1, True),
    (2, 4, 2, 2, True), (4, 2, 1, 4, False), (4, 2, 1, 4, True), (4, 4, 2, 4, False), (8, 4, 1, 4, True),
    (4, 4, 2, 2, True), (2, 2, 1, 4, False), (4, 2, 1, 8, False), (8, 2, 1, 2, False), (4, 2, 1, 2, False),
    (8, 2, 1, 4, False, 2))]
# More block shapes the INT8/INT4 words kernel gains from at 32 and 64 rows (fewer pipeline stages, longer steps:
# int4 batch 32 5.88 → 5.34 ms a step, int8 batch 64 5.57 → 5.39 on an H200); the float kernel keeps its own.
WORDS_EXTRA: dict[int, list[Config]] = {32: _configs(32, (64, 256, 4, 3), (64, 512, 4, 3)),
                                        64: _configs(64, (128, 128, 4, 3), (32, 128, 4, 4))}
# The one-row INT4 kernel: the layouts that were fastest for some 6B matrix on an H200, and their neighbours.
PAIR_CANDIDATES = [PairConfig(*shape) for shape in ((4, 2, 1, 4), (4, 1, 1, 8), (4, 2, 2, 4), (2, 2, 1, 4),
                                                    (8, 2, 1, 4))]
MMA_CANDIDATES = [MmaConfig(*shape) for shape in ((4, 8, 8), (1, 8, 8), (2, 8, 8), (4, 8, 4), (1, 8, 4), (4, 8, 2))]
CUBLAS = Config(-1, 0, 0, 0, 0)
AnyConfig = Config | GemvConfig | PairConfig | MmaConfig
CHOSEN: dict[tuple, AnyConfig] = {}  # (weight kind, row bucket, N, K, swiglu) -> config
TIMED: dict[tuple, dict[AnyConfig, float]] = {}  # the same keys -> each candidate's time alone, as `tune` took it


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, weight: int,
           swiglu: bool = False, config: AnyConfig | None = None, out_dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """x `[M, K_in]` · Ŵᵀ + bias, Ŵ = stored weight × per-row scale, accumulated in float32; `[M, N]` in out_dtype
    (default x's: the kernels round once to it).

    `swiglu`: x rows are [up; gate] and the input is silu(gate)·up (fused by the one-row kernels).
    """
    m, n = x.shape[0], w.shape[0]
    config = config or CHOSEN.get(matmul_key(x, w, weight, swiglu)) or default_config(weight, m, gluon_available(x))
    if isinstance(config, MmaConfig) and not (gluon_available(x) and m <= 8) or \
            isinstance(config, PairConfig) and not (gluon_available(x) and m == 1 and weight == INT4):
        config = CANDIDATES[16][0]
    if config == CUBLAS:  # INT8/INT4: the weights dequantized first (prompts: many rows, compute-bound)
        w = w if weight == FLOAT else dequantize(w.view(torch.int32), scale, weight, x.dtype)
        return F.linear(silu_mul(x) if swiglu else x, w, bias).to(out_dtype or x.dtype)
    fused = isinstance(config, GemvConfig) and gluon_available(x) and weight == INT8 or isinstance(config, Config) \
        and config.block_m == 0 and weight == FLOAT
    if swiglu and not (fused and config.fuse_swiglu):
        x, swiglu = silu_mul(x), False
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    scale_arg = scale if scale is not None else w
    bias_arg = bias if bias is not None else w
    if weight != FLOAT:
        _matmul_words(x, w.view(torch.int32), scale, bias, y, weight, swiglu, config)
    elif config.block_m == 0:
        _gemv_kernel[(triton.cdiv(n, config.block_n),)](x, w, scale_arg, bias_arg, y, n, w.shape[1], SWIGLU=swiglu,
                                                        HAS_BIAS=bias is not None, BLOCK_N=config.block_n,
                                                        BLOCK_K=config.block_k, num_warps=config.warps,
                                                        num_stages=config.stages, **pdl(x.device))
    else:
        _matmul_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))](
            x, w, scale_arg, bias_arg, y, m, n, w.shape[1], HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.warps, num_stages=config.stages,
            **pdl(x.device))
    return y


def _matmul_words(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  y: torch.Tensor, weight: int, swiglu: bool, config: AnyConfig) -> None:
    m, (n, count) = x.shape[0], words.shape
    bias_arg = bias if bias is not None else scale
    if isinstance(config, MmaConfig):
        gluon_gemv.gemv_mma(x, words, scale, bias, y, weight, *config, **pdl(x.device))
    elif isinstance(config, PairConfig):
        gluon_gemv.gemv_pairs(x, words, scale, bias, y, *config, **pdl(x.device))
    elif isinstance(config, GemvConfig) and gluon_available(x) and weight == INT8:
        gluon_gemv.gemv_words(x, words, scale, bias, y, swiglu, *config[:6], **pdl(x.device))
    elif isinstance(config, GemvConfig):
        _gemv_words_kernel[(triton.cdiv(n, config.block_n),)](
            x, words, scale, bias_arg, y, n, count, WEIGHT=weight, HAS_BIAS=bias is not None,
            BLOCK_N=config.block_n, BLOCK_W=config.block_w, num_warps=config.warps_n * config.warps_w, **pdl(x.device))
    elif config.block_m == 0:
        raise ValueError("the one-row INT8/INT4 kernel takes a GemvConfig")
    else:
        features_per_word = 8 if weight == INT4 else 4
        _matmul_words_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))](
            x, words, scale, bias_arg, y, m, n, count, WEIGHT=weight, HAS_BIAS=bias is not None,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_W=config.block_k // features_per_word,
            num_warps=config.warps, num_stages=config.stages, **pdl(x.device))


def candidates(weight: int, bucket: int, gluon: bool = False) -> list[AnyConfig]:
    """The block shapes `tune` times for a weight kind and row bucket (cuBLAS is added for float weights); `gluon`:
    the input can go to the Gluon kernels (gluon_available)."""
    if weight == FLOAT:
        return CANDIDATES[bucket if bucket != 8 else 16]
    tensor_cores = MMA_CANDIDATES if gluon else []
    if bucket == 1:
        return (PAIR_CANDIDATES if gluon and weight == INT4 else GEMV_CANDIDATES) + tensor_cores
    if bucket == 8:
        return tensor_cores + CANDIDATES[16]
    return CANDIDATES[bucket] + WORDS_EXTRA.get(bucket, [])


def default_config(weight: int, rows: int, gluon: bool = False) -> AnyConfig:
    """Untuned: cuBLAS for float weights, else the first candidate of the row bucket."""
    return CUBLAS if weight == FLOAT else candidates(weight, row_bucket(rows), gluon)[0]


def matmul_key(x: torch.Tensor, w: torch.Tensor, weight: int, swiglu: bool) -> tuple:
    """What `tune` chooses a config for: (weight kind, row bucket, N, stored columns, swiglu)."""
    return weight, row_bucket(x.shape[0]), w.shape[0], w.shape[1], swiglu


def tune(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, weight: int,
         swiglu: bool = False) -> tuple:
    """Time the candidates on this shape, and cuBLAS for float weights and for prompts (after dequantizing INT8/INT4
    weights); remember the fastest in CHOSEN. Returns the key (`matmul_key`) it is remembered under."""
    key = matmul_key(x, w, weight, swiglu)
    if weight == FLOAT and key[1] == 128:
        CHOSEN[key] = CUBLAS  # prompts: compute-bound, cuBLAS's ground
    if key not in CHOSEN:
        options = list(candidates(weight, key[1], gluon_available(x))) + \
            ([CUBLAS] if weight == FLOAT or key[1] == 128 else [])
        if swiglu:  # fused SwiGLU recomputes silu in every program: time it against a kernel of its own
            options += [c._replace(fuse_swiglu=False) for c in options if getattr(c, "fuse_swiglu", False)
                        and (isinstance(c, GemvConfig) or c.block_m == 0)]
        timings = {}
        for config in options:
            try:
                timings[config] = graph_time_ms(lambda c=config: matmul(x, w, scale, bias, weight, swiglu, c))
            except OutOfResources:  # too large a tile for this GPU
                continue
        TIMED[key] = timings
        CHOSEN[key] = min(timings, key=timings.get)
    return key


def rivals(key: tuple, within: float) -> list[AnyConfig]:
    """The configs `tune` timed within `within` (a fraction) of the fastest one for `key`, fastest first."""
    timings = TIMED.get(key, {})
    fastest = min(timings.values(), default=0.0)
    return sorted((c for c, ms in timings.items() if ms <= fastest * (1 + within)), key=timings.get)
