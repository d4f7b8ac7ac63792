"""`trtglm plan`: will a profile fit on a GPU, and how much KV cache is left?

All figures are per GPU (rank); tensor parallelism splits everything but the embedding
and the norms. The estimate:

- weights: embedding (whole on every rank) and lm_head (split by vocabulary rows) in the
  activation dtype; per layer the qkv, dense, fc and proj matrices split by tp, at 1 byte
  (int8) or 0.5 byte (int4) per parameter under weight-only quantization plus one scale per
  output channel in the activation dtype, or 1 byte (FP8) with one scale per matrix; qkv bias
  and norms in the activation dtype. With tp > KV heads each rank holds one (duplicated) KV head.
- KV cache per token: 2 (K, V) × layers × KV heads per rank × head_dim × dtype bytes (1 for an
  FP8 KV cache).
- activations: max_num_tokens × (2·ffn/tp + qkv rows per rank + 4·hidden) × dtype bytes
  (the fc output, the attention input and a few hidden-size buffers live at once), plus the
  float32 logits of max_batch_size sequences over the whole vocabulary.
- overhead: a fixed 1 GiB for the CUDA context, cuBLAS/TensorRT workspaces and NCCL.

The KV cache gets `serve.kv_cache_free_gpu_mem_fraction` of what is left (as TensorRT-LLM's
runtime allocates it), rounded down to whole blocks of build.tokens_per_block for a paged
cache. Checked against THUDM's published minimum memory for encoding 2048 tokens (6B
fp16/int8/int4: 13.1/8.2/5.5 GB): the total here (weights + KV + activations + overhead
for one 2048-token prompt) lands within 6 % of each.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtglm.chatglm.config import CHATGLM3_6B_CONFIG, ChatGLMConfig, kv_bytes_per_position, kv_heads_per_rank
from trtglm.errors import ModelFileError, UsageError
from trtglm.profile import LONG_CONTEXT_TOKEN_LIMIT, Profile, load_profile, read_model_config

log = logging.getLogger(__name__)

GiB = 1 << 30
OVERHEAD_BYTES = 1 * GiB
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
WEIGHT_BITS = {None: None, "int8": 8, "int4": 4, "fp8": 8}  # a weight kind: weight-only's mode, or fp8
PER_CHANNEL_SCALES = ("int8", "int4")  # weight-only's scales, one per output channel (FP8's: one per matrix)
LOGITS_BYTES = 4  # float32 logits
_UNITS = {"": None, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


SHAPES_6B = ChatGLMConfig.from_hf_dict(CHATGLM3_6B_CONFIG, "chatglm3")
SHAPES_6B_SOURCE = "ChatGLM3-6B's published config"


# --- the estimate ---------------------------------------------------------------------------------


def qkv_rows_per_rank(shape: ChatGLMConfig, tp: int) -> int:
    return (shape.num_heads // tp + 2 * kv_heads_per_rank(shape.num_kv_heads, tp)) * shape.head_dim


def weight_bytes(shape: ChatGLMConfig, dtype: str, weight_only: str | None = None, tp: int = 1) -> int:
    """Bytes of one rank's weights."""
    act = DTYPE_BYTES[dtype]
    h, qkv = shape.hidden_size, qkv_rows_per_rank(shape, tp)
    ffn_r, attn_r = shape.ffn_hidden_size // tp, shape.num_heads * shape.head_dim // tp
    linear_params = qkv * h + h * attn_r + 2 * ffn_r * h + h * ffn_r
    out_channels = qkv + h + 2 * ffn_r + h
    bits = WEIGHT_BITS[weight_only]
    scales = out_channels * act if weight_only in PER_CHANNEL_SCALES else 0
    linear = linear_params * act if bits is None else linear_params * bits // 8 + scales
    per_layer = linear + (qkv + 2 * h) * act  # qkv bias, two norms
    embedding = shape.vocab_size * h * act
    lm_head = math.ceil(shape.vocab_size / tp) * h * act
    return embedding + lm_head + h * act + shape.num_layers * per_layer


def kv_bytes_per_token(shape: ChatGLMConfig, dtype: str, tp: int = 1, fp8: bool = False) -> int:
    return kv_bytes_per_position(shape.num_layers, shape.num_kv_heads, shape.head_dim, tp,
                                 1 if fp8 else DTYPE_BYTES[dtype])


def token_activation_bytes(shape: ChatGLMConfig, dtype: str, tp: int = 1) -> int:
    """Activation bytes per token in flight (see the module docstring)."""
    width = 2 * shape.ffn_hidden_size // tp + qkv_rows_per_rank(shape, tp) + 4 * shape.hidden_size
    return width * DTYPE_BYTES[dtype]


def logits_bytes(shape: ChatGLMConfig, batch_size: int) -> int:
    return batch_size * shape.vocab_size * LOGITS_BYTES


def activation_bytes(shape: ChatGLMConfig, dtype: str, tp: int, num_tokens: int, batch_size: int) -> int:
    return num_tokens * token_activation_bytes(shape, dtype, tp) + logits_bytes(shape, batch_size)


def footprint(shape: ChatGLMConfig, dtype: str, weight_only: str | None, tp: int, tokens: int,
              batch_size: int = 1) -> int:
    """Bytes one rank needs to run `tokens` tokens at once: weights + their KV + activations + overhead."""
    return (weight_bytes(shape, dtype, weight_only, tp) + tokens * kv_bytes_per_token(shape, dtype, tp)
            + activation_bytes(shape, dtype, tp, tokens, batch_size) + OVERHEAD_BYTES)


@dataclass(frozen=True)
class MemoryPlan:
    profile: str
    shape: ChatGLMConfig
    shape_source: str  # the config.json the shapes come from, or SHAPES_6B_SOURCE
    gpus: int
    gpu_bytes: int
    weights: int
    activations: int
    overhead: int
    kv_per_token: int
    kv_budget: int  # what the KV cache gets (the fraction of what is left)
    kv_tokens: int  # tokens of KV cache that fit
    needed_tokens: int  # max_batch_size × max_beam_width × max_seq_len
    max_batch_size: int  # the largest that fits at max_seq_len (and within the 32k models' token limit)
    max_num_tokens: int  # the largest that fits at the profile's max_batch_size
    warnings: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.warnings

    @property
    def left(self) -> int:
        return self.gpu_bytes - self.weights - self.activations - self.overhead


def memory_plan(profile: Profile, shape: ChatGLMConfig, gpu_bytes: int, shape_source: str = "") -> MemoryPlan:
    b, c, s = profile.build, profile.convert, profile.serve
    tp, fraction, seq = c.tp_size, s.kv_cache_free_gpu_mem_fraction, b.max_seq_len * b.max_beam_width
    weights = weight_bytes(shape, c.dtype, c.weight_only or ("fp8" if c.fp8 else None), tp)
    per_token_act = token_activation_bytes(shape, c.dtype, tp)
    activations = b.max_num_tokens * per_token_act + logits_bytes(shape, b.max_batch_size)
    kv = kv_bytes_per_token(shape, c.dtype, tp, c.fp8_kv_cache)
    left = gpu_bytes - weights - activations - OVERHEAD_BYTES
    kv_budget = int(fraction * max(0, left))
    kv_tokens = kv_budget // kv
    if b.kv_cache_type == "paged":
        kv_tokens -= kv_tokens % b.tokens_per_block
    needed = b.max_batch_size * seq
    static = gpu_bytes - weights - OVERHEAD_BYTES
    batch_fit = max(0, math.floor(fraction * (static - b.max_num_tokens * per_token_act)
                                  / (seq * kv + fraction * shape.vocab_size * LOGITS_BYTES)))
    if profile.variant.token_limit:
        batch_fit = min(batch_fit, LONG_CONTEXT_TOKEN_LIMIT // seq)
    tokens_fit = (static - logits_bytes(shape, b.max_batch_size) - needed * kv / fraction) // per_token_act
    tokens_fit = int(max(0, min(tokens_fit, b.max_batch_size * b.max_seq_len)))
    warnings = []
    if left <= 0:
        warnings.append(f"does not fit: weights, activations and overhead need {_gib(gpu_bytes - left)} of "
                        f"{_gib(gpu_bytes)} per GPU")
    elif kv_tokens < needed:
        warnings.append(f"KV cache holds {kv_tokens:,} tokens, fewer than max_batch_size × max_beam_width × "
                        f"max_seq_len = {needed:,}: at most {kv_tokens // seq} full-length sequences at once "
                        f"(build.max_batch_size ≤ {batch_fit} fits)")
    return MemoryPlan(profile.name, shape, shape_source, profile.world_size, gpu_bytes, weights, activations,
                      OVERHEAD_BYTES, kv, kv_budget, kv_tokens, needed, batch_fit, tokens_fit, tuple(warnings))


# --- the command ----------------------------------------------------------------------------------


def plan(config: str | Path, *, gpu_memory: str | int | float, gpus: int | None, overrides: dict[str, Any],
         strict: bool) -> MemoryPlan:
    """Print the memory plan of a profile on GPUs of `gpu_memory`; `gpus` plans for tp = gpus.

    A profile that does not fit is a warning (exit 0), or a UsageError with `strict`.
    """
    gpu_bytes = parse_memory(gpu_memory)
    overrides = dict(overrides)
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise UsageError(f"--gpus must be a positive integer, not {gpus!r}")
        overrides["convert.tp_size"] = gpus
    profile = load_profile(config, overrides)
    shape, source = model_shape(profile)
    result = memory_plan(profile, shape, gpu_bytes, source)
    print(format_plan(profile, result))
    for warning in result.warnings:
        log.warning("warning: %s: %s", profile.path, warning)
    if strict and not result.fits:
        raise UsageError(f"{profile.path}: {result.warnings[0]}")
    return result


def model_shape(profile: Profile) -> tuple[ChatGLMConfig, str]:
    """(shapes, where they come from): the HF config.json when readable, else the variant's published shapes."""
    cfg = read_model_config(profile)
    if cfg is not None:
        return cfg, str(Path(profile.model.dir) / "config.json")
    if profile.variant.six_b_shapes:
        return SHAPES_6B, SHAPES_6B_SOURCE
    raise ModelFileError(f"{profile.path}: model.variant {profile.model.variant} has no published shapes and "
                         f"{profile.model.dir or 'model.dir'}/config.json is not readable")


def parse_memory(text: str | int | float) -> int:
    """Bytes in "80GiB", "80GB" (10^9), "24G" (binary, like `free -g`), "16000MiB", "1.5TB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = _UNITS.get(match.group(2).lower(), 0) if match else 0
    if not match or unit == 0:
        raise UsageError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 80GB, 24G or 16000MiB")
    if unit is None:
        raise UsageError(f"--gpu-memory {text!r}: give a unit, e.g. {text}GiB")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise UsageError(f"--gpu-memory {text!r} must be more than zero")
    return size


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_plan(profile: Profile, p: MemoryPlan) -> str:
    b, c, s, shape = profile.build, profile.convert, profile.serve, p.shape
    precision = c.dtype + (f", weight-only {c.weight_only}" if c.weight_only else "") + \
        (", FP8" if c.fp8 else "") + (" and FP8 KV cache" if c.fp8_kv_cache else "")
    rows = [
        ("profile", f"{profile.name} ({profile.path})"),
        ("model", f"{profile.model.variant}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
                  f"{shape.num_heads} heads ({shape.num_kv_heads} KV) × {shape.head_dim}, ffn "
                  f"{shape.ffn_hidden_size}, vocab {shape.vocab_size} (from {p.shape_source})"),
        ("precision", f"{precision}; tp {c.tp_size} × pp {c.pp_size} on {p.gpus} GPU(s) of {_gib(p.gpu_bytes)}"),
        ("weights / GPU", _gib(p.weights)),
        ("activations / GPU", f"{_gib(p.activations)} (max_num_tokens {b.max_num_tokens}, "
                              f"max_batch_size {b.max_batch_size})"),
        ("overhead / GPU", f"{_gib(p.overhead)} (CUDA context, workspaces)"),
        ("left / GPU", _gib(p.left)),
        ("KV cache / GPU", f"{_gib(p.kv_budget)} ({s.kv_cache_free_gpu_mem_fraction:.0%} of what is left)"),
        ("KV bytes per token", f"{p.kv_per_token:,}"),
        ("KV tokens that fit", f"{p.kv_tokens:,}"),
        ("KV tokens needed", f"{p.needed_tokens:,} (max_batch_size {b.max_batch_size} × max_beam_width "
                             f"{b.max_beam_width} × max_seq_len {b.max_seq_len})"),
        ("largest max_batch_size", f"{p.max_batch_size} at max_seq_len {b.max_seq_len}"),
        ("largest max_num_tokens", f"{p.max_num_tokens:,} at max_batch_size {b.max_batch_size}"),
        ("verdict", "fits" if p.fits else "DOES NOT FIT (see the warning)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
