"""ChatGLM3 forward pass over the tensor-parallel shards of a TensorRT-LLM checkpoint.

Each `RankModel` holds one rank's tensors exactly as written and computes that rank's
partial results: its query/KV heads and the matching input columns of `dense`, its
`[up; gate]` rows of `fc` and the matching columns of `proj`, its rows of `lm_head`.
`ShardedModel` runs the ranks in lockstep and combines the partials through a process group:
a sum after `dense` and after `proj`, a concatenation of the lm_head chunks. `LocalGroup`
does that for ranks held by this process; a served multi-process runtime holds one rank per
process (`load_model(..., rank=r, group=...)`) with a group that calls
`torch.distributed.all_reduce` / `all_gather` (trtglm.runtime.distributed).

The computation (shared facts: chatglm3.md): embedding → layers × [RMSNorm → attention →
residual → RMSNorm → SwiGLU MLP → residual] → RMSNorm → lm_head. RMSNorm and rotary are
computed in float32; matmuls in the compute dtype; logits are returned in float32.

An FP8 checkpoint runs dequantized (runtime/quant.py): each quantized linear's input goes through FP8 at
its static scale and its weight is its FP8 values times their scale, and with an FP8 KV cache the keys
and values go through FP8 at their layer's scale before they are kept: the same function as the fast
runtime's FP8 matmuls and cache, so this is their reference (on the CPU, the way FP8 checkpoints run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from trtglm.conventions import INPUT_SCALE, KV_SCALE, WEIGHT_SCALE
from trtglm.errors import UsageError
from trtglm.runtime.checkpoint import DTYPES, Checkpoint, CheckpointConfig, load_checkpoint, load_rank, read_config
from trtglm.runtime.cache import ForwardCache
from trtglm.runtime.quant import Fp8Weight, QuantizedWeight, fake_quantize_fp8, is_quantized, quantize

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight | Fp8Weight


class Group(Protocol):
    """How the partial results of the ranks held here are combined with those of all ranks."""

    def all_reduce(self, parts: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def all_gather(self, parts: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor: ...


class LocalGroup:
    """Collectives over ranks that live in this process: a plain sum / concatenation."""

    def all_reduce(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(parts[0].dtype)

    def all_gather(self, parts: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
        return torch.cat(list(parts), dim=dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight.apply(x, bias)  # quantized weights compute their own product (quant.py)


def rotary_tables(cfg: CheckpointConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[B, 1, T, rotary_dim/2]` for GPT-J style rotary at the given positions."""
    half = cfg.rotary_dim // 2
    exponents = torch.arange(half, device=positions.device, dtype=torch.float32) * 2 / cfg.rotary_dim
    inv_freq = 1.0 / cfg.rotary_base ** exponents
    angles = (positions.float() / cfg.position_scale)[..., None] * inv_freq
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3)… of the first rotary_dim features of `x` `[B, H, T, D]`."""
    rot_dim = 2 * cos.shape[-1]
    pairs = x[..., :rot_dim].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rot_dim:]), dim=-1)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    dense: Weight
    post_norm: torch.Tensor
    fc: Weight
    proj: Weight
    kv_scale: float | None = None  # an FP8 KV cache's: keys and values are kept as FP8 values of this scale


Tensors = Callable[[str], torch.Tensor]  # a rank's checkpoint tensor by name, as stored


def load_weight(cfg: CheckpointConfig, tensor: Tensors, name: str, dtype: torch.dtype,
                device: str | torch.device) -> Weight:
    """One checkpoint tensor on `device`: weight-only quantized where the checkpoint says so, FP8 as stored (with
    its scales), anything else in `dtype`."""
    if cfg.fp8 and is_quantized(name):
        prefix = name.removesuffix(".weight")
        scale, input_scale = (tensor(f"{prefix}.{kind}").to(device).float().reshape(())
                              for kind in (WEIGHT_SCALE, INPUT_SCALE))
        return Fp8Weight(tensor(name).to(device), scale, input_scale)
    if cfg.quant_algo and is_quantized(name):
        return quantize(tensor(name), cfg.quant_algo).to(device)
    return tensor(name).to(device=device, dtype=dtype)


def layer_weights(cfg: CheckpointConfig, tensor: Tensors, layer: int, dtype: torch.dtype,
                  device: str | torch.device) -> LayerWeights:
    p = f"transformer.layers.{layer}."

    def get(name: str) -> Weight:
        return load_weight(cfg, tensor, p + name, dtype, device)

    return LayerWeights(input_norm=get("input_layernorm.weight"), qkv=get("attention.qkv.weight"),
                        qkv_bias=get("attention.qkv.bias") if cfg.add_qkv_bias else None,
                        dense=get("attention.dense.weight"), post_norm=get("post_layernorm.weight"),
                        fc=get("mlp.fc.weight"), proj=get("mlp.proj.weight"),
                        kv_scale=float(tensor(f"{p}attention.{KV_SCALE}")) if cfg.fp8_kv_cache else None)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_block(cfg: CheckpointConfig, w: LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    attend: Attend) -> torch.Tensor:
    """One rank's share of attention(RMSNorm(x)) · denseᵀ; `attend(q, k, v)` (`[B, heads, T, head]` each, q and k
    rotated) keeps k and v where the cache holds them and attends."""
    batch, length, _ = x.shape
    q_size, kv_size = cfg.heads_per_rank * cfg.head_size, cfg.kv_heads_per_rank * cfg.head_size
    qkv = linear(rms_norm(x, w.input_norm, cfg.norm_epsilon), w.qkv, w.qkv_bias)
    q, k, v = (t.unflatten(-1, (-1, cfg.head_size)).transpose(1, 2)
               for t in qkv.split((q_size, kv_size, kv_size), dim=-1))
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    if w.kv_scale is not None:  # what an FP8 KV cache gives back
        k, v = fake_quantize_fp8(k, w.kv_scale), fake_quantize_fp8(v, w.kv_scale)
    out = attend(q, k, v)
    return linear(out.transpose(1, 2).reshape(batch, length, q_size), w.dense)


def mlp_block(cfg: CheckpointConfig, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """One rank's share of SwiGLU(RMSNorm(x)) · projᵀ; fc rows are [up; gate]."""
    up, gate = linear(rms_norm(x, w.post_norm, cfg.norm_epsilon), w.fc).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w.proj)


class RankModel:
    """One tensor-parallel rank: its own weights and the partial results they give."""

    def __init__(self, cfg: CheckpointConfig, rank: int, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: str | torch.device):
        self.cfg, self.rank = cfg, rank
        self.embedding, self.final_norm, self.lm_head = (
            load_weight(cfg, tensors.__getitem__, name, dtype, device)
            for name in ("transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"))
        self.layers = [layer_weights(cfg, tensors.__getitem__, layer, dtype, device) for layer in range(cfg.num_layers)]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embedding)

    def attention(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  cache: ForwardCache, mask: torch.Tensor | None) -> torch.Tensor:
        """This rank's share of attention(RMSNorm(x)) · denseᵀ; it also fills the KV cache."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            own = getattr(cache, "attend", None)  # a packed view of several slots attends piece by piece
            if own is not None:
                return own(self.rank, layer, q, k, v)
            keys, values = cache.append(self.rank, layer, k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

        return attention_block(self.cfg, self.layers[layer], x, rope, attend)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return mlp_block(self.cfg, self.layers[layer], x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary chunk of the logits."""
        return linear(rms_norm(x, self.final_norm, self.cfg.norm_epsilon), self.lm_head)


class ShardedModel:
    """All ranks of a checkpoint run in lockstep; partial results combined through `group`."""

    def __init__(self, cfg: CheckpointConfig, ranks: list[RankModel], group: Group | None = None):
        self.config, self.ranks, self.group = cfg, ranks, group or LocalGroup()
        self.dtype = ranks[0].embedding.dtype
        self.device = ranks[0].embedding.device

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ForwardCache, positions: torch.Tensor | None = None,
                last_only: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits `[B, T, vocab]` for `tokens` `[B, T]` appended after the cache's contents.

        `positions` `[B, T]` default to the cache slots. Cache slots not marked valid (left
        padding) are not attended to; a cache view with an `attend` method attends itself (the
        packed pieces of a mixed step). `last_only`: logits of the last position only
        (`[B, 1, vocab]`), as generation needs; `rows`: of those positions only.
        """
        tokens = tokens.to(self.device)
        batch, length = tokens.shape
        start = cache.length
        slots = torch.arange(start, start + length, device=self.device)
        if positions is None:
            positions = slots.expand(batch, length)
        cache.mark_valid(length)
        mask = None if hasattr(cache, "attend") else self._mask(cache, slots)
        rope = rotary_tables(self.config, positions.to(self.device))
        xs = [rank.embed(tokens) for rank in self.ranks]
        for layer in range(self.config.num_layers):
            attn = self.group.all_reduce([r.attention(layer, x, rope, cache, mask) for r, x in zip(self.ranks, xs)])
            xs = [x + attn for x in xs]
            mlp = self.group.all_reduce([r.mlp(layer, x) for r, x in zip(self.ranks, xs)])
            xs = [x + mlp for x in xs]
        cache.advance(length)
        if last_only:
            xs = [x[:, -1:] for x in xs]
        elif rows is not None:
            xs = [x[:, rows] for x in xs]
        return self.group.all_gather([r.logits(x) for r, x in zip(self.ranks, xs)]).float()

    @staticmethod
    def _mask(cache: ForwardCache, slots: torch.Tensor) -> torch.Tensor:
        """`[B, 1, T, S]` bool: causal, and only slots holding real tokens (not left padding)."""
        keys = torch.arange(int(slots[-1]) + 1, device=slots.device)
        causal = keys[None, :] <= slots[:, None]
        return (causal[None] & cache.valid[:, None, : len(keys)])[:, None]


def load_model(path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
               checkpoint: Checkpoint | None = None, rank: int | None = None,
               group: Group | None = None) -> ShardedModel:
    """A runnable model from a checkpoint folder, in the checkpoint's dtype unless `dtype` says otherwise.

    With `rank`, only that rank's shard is read and held (one process per rank); `group` then
    combines its partial results with the other processes' (the default LocalGroup suits
    all ranks in one process).
    """
    if rank is not None:
        ckpt = one_rank_checkpoint(path, rank)
    else:
        ckpt = checkpoint or load_checkpoint(path)
    cfg = ckpt.config
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        dtype = DTYPES[dtype]
    dtype = dtype or cfg.torch_dtype
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but CUDA is not available")
    log.info("loading %s: %d layer(s), tp %d, %s%s%s on %s", ckpt.path, cfg.num_layers, cfg.tp_size,
             str(dtype).removeprefix("torch."), _quantization(cfg), ", FP8 KV cache" if cfg.fp8_kv_cache else "",
             device)
    numbers = [rank] if rank is not None else range(cfg.world_size)
    ranks = [RankModel(cfg, r, tensors, dtype, device) for r, tensors in zip(numbers, ckpt.ranks, strict=True)]
    return ShardedModel(cfg, ranks, group)


def _quantization(cfg: CheckpointConfig) -> str:
    if cfg.fp8:
        return ", FP8 weights and activations (dequantized)"
    return f", weight-only {cfg.quant_algo}" if cfg.quant_algo else ""


def one_rank_checkpoint(path: str | Path, rank: int) -> Checkpoint:
    """A checkpoint holding only `rank`'s tensors (validated as `load_checkpoint` validates them)."""
    path = Path(path)
    cfg = read_config(path)
    if not 0 <= rank < cfg.world_size:
        raise UsageError(f"rank {rank} is outside the checkpoint's world size {cfg.world_size} ({path})")
    return Checkpoint(path, cfg, [load_rank(path / f"rank{rank}.safetensors", cfg)])
