"""The fused steps of the fast model, as plain torch (the definition) or as Triton kernels (the speed).

`TorchOps` runs anywhere and states what each step computes; `TritonOps` does the same in
one kernel per step (kernels.py). `select_ops` gives Triton on CUDA when it is installed,
torch otherwise. Tests check the one against the other.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from trtglm.runtime.quant import to_fp8


class TorchOps:
    """Reference implementations: few, readable tensor operations, float32 where the kernels use it."""

    name = "torch"

    @staticmethod
    def decode_inputs(tokens: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, embedding: torch.Tensor,
                      scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = seq_len[slots]
        seq_len[slots] = torch.where(slots == scratch, 0, positions + 1)  # the scratch slot stays at length 0
        return F.embedding(tokens, embedding), positions

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if delta is None else (x.float() + delta.float()).to(x.dtype)
        xf = total.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return total, out.to(x.dtype)

    @staticmethod
    def rope_cache(qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                   num_heads: int, kv_scale: float = 1.0) -> torch.Tensor:
        _, kv_heads, block_size, head = k_cache.shape
        heads = qkv.unflatten(-1, (num_heads + 2 * kv_heads, head))
        pos = positions.long()
        rotated = _rotate(heads[:, : num_heads + kv_heads], cos[pos][:, None], sin[pos][:, None])
        q, k, v = rotated[:, :num_heads], rotated[:, num_heads:], heads[:, num_heads + kv_heads:]
        blocks = table[slots.long(), pos // block_size].long()
        k_cache[blocks, :, pos % block_size] = to_cache(k.to(qkv.dtype), k_cache.dtype, kv_scale)
        v_cache[blocks, :, pos % block_size] = to_cache(v, v_cache.dtype, kv_scale)
        return q.to(qkv.dtype).contiguous()

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         slots: torch.Tensor, positions: torch.Tensor, length: int | None = None,
                         kv_scale: float = 1.0) -> torch.Tensor:
        batch, num_heads, head = q.shape
        keys = slot_values(k_cache, table, slots, length, kv_scale, torch.float32)  # [B, KVH, L, D]
        values = slot_values(v_cache, table, slots, length, kv_scale, torch.float32)
        visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= positions.long()[:, None]
        out = F.scaled_dot_product_attention(q.float()[:, :, None], keys, values, attn_mask=visible[:, None, None],
                                             enable_gqa=True)
        return out.reshape(batch, num_heads * head).to(q.dtype)

    @classmethod
    def decode_qkv_attention(cls, qkv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                             num_heads: int, kv_scale: float = 1.0) -> torch.Tensor:
        """rope_cache, then decode_attention of the rotated queries."""
        q = cls.rope_cache(qkv, slots, positions, cos, sin, k_cache, v_cache, table, num_heads, kv_scale)
        return cls.decode_attention(q, k_cache, v_cache, table, slots, positions, kv_scale=kv_scale)

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        up, gate = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)


def slot_positions(cache: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, length: int | None = None
                   ) -> torch.Tensor:
    """Positions 0…length-1 (None: as many as a slot can hold) of each of `slots` in one layer's paged cache
    (`[blocks, kv_heads, block_size, head]`, each slot's blocks in its row of `table`), gathered: `[B, kv_heads,
    length, head]`."""
    block_size = cache.shape[2]
    count = table.shape[1] if length is None else -(-length // block_size)
    gathered = cache[table[slots.long(), :count].long()]  # [B, blocks, kv_heads, block_size, head]
    return gathered.transpose(1, 2).flatten(2, 3)[:, :, :length]


def to_cache(t: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Keys or values as a cache of `dtype` keeps them: an FP8 cache at `kv_scale` (quant.to_fp8)."""
    return to_fp8(t, kv_scale) if dtype == torch.float8_e4m3fn else t.to(dtype)


def slot_values(cache: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, length: int | None, kv_scale: float,
                dtype: torch.dtype) -> torch.Tensor:
    """`slot_positions` as keys or values in `dtype`: an FP8 cache's stored values times `kv_scale`."""
    gathered = slot_positions(cache, table, slots, length)
    if cache.dtype == torch.float8_e4m3fn:
        return (gathered.float() * kv_scale).to(dtype)
    return gathered.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J rotary on the first 2·cos.shape[-1] features of `[T, heads, D]`, in float32."""
    rot = 2 * cos.shape[-1]
    pairs = x[..., :rot].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot:].float()), dim=-1)


class TritonOps:
    """The same steps as Triton kernels (one launch each)."""

    name = "triton"

    def __init__(self) -> None:
        from trtglm.runtime.fast import kernels

        self.decode_inputs = kernels.decode_inputs
        self.add_rms_norm = kernels.add_rms_norm
        self.rope_cache = kernels.rope_cache
        self.decode_attention = kernels.decode_attention
        self.decode_qkv_attention = kernels.decode_qkv_attention
        self.silu_mul = kernels.silu_mul


Ops = TorchOps | TritonOps


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_ops(device: torch.device, kernels: str = "auto") -> Ops:
    """`auto`: Triton on CUDA when installed, else torch; `torch` / `triton` force one."""
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" and triton_available() else "torch"
    return TritonOps() if kernels == "triton" else TorchOps()
