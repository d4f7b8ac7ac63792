"""Weight-only quantization (W8A16 / W4A16) as TensorRT-LLM applies it to a float checkpoint, and the
arithmetic of FP8 checkpoints (quant_algo FP8).

TensorRT-LLM quantizes the `qkv`, `dense`, `fc` and `proj` weights of each rank at build
time: symmetric, one scale per output channel (row of the `[out, in]` weight), computed over
that rank's input features:

    scale = max_j |w[i, j]| / qmax          qmax = 127 (int8) or 7 (int4)
    q     = clamp(round(w / scale), -qmax - 1, qmax)
    ŵ     = q × scale

Embedding, norms, lm_head and biases stay in float. Because the scale is per rank, a
weight split by columns (`dense`, `proj`) gets one scale per row *per column chunk*;
`fake_quantize(..., in_chunks=tp)` reproduces that on an unsplit weight.

The arithmetic is done in float32 on the stored (checkpoint-dtype) values. Here int4 values
are kept unpacked in int8 storage and dequantized to the compute dtype for each matmul: a
simple, exact path (GPU kernels come later).

FP8 (TensorRT-LLM's FP8Linear; conventions.py names the tensors): a weight is stored in float8_e4m3fn
with one float32 scale for the whole tensor, and its input is quantized with a static scale found by
calibration (the largest input seen / 448):

    q(t, s) = float8_e4m3fn(clamp(t / s, -448, 448))
    y       = (q(x, s_x) · s_x) · (W_q · s_w)ᵀ + b

`fp8_linear` computes that product from the dequantized values (the reference the GPU's FP8 matmul is
checked against: torch._scaled_mm computes the same products, accumulated in float32). An FP8 KV cache
holds q(k, s_kv) and q(v, s_kv) per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtglm.conventions import FP8_MAX

QMAX = {"W8A16": 127, "W4A16": 7}
QUANTIZED_SUFFIXES = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.proj.weight")


@dataclass
class QuantizedWeight:
    """An `[out, in]` weight as int8 values (int4 range for W4A16) and a float32 scale per row."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.values.float() * self.scale[:, None]).to(dtype)

    def to(self, device: str | torch.device) -> "QuantizedWeight":
        return QuantizedWeight(self.values.to(device), self.scale.to(device))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), bias)


def is_quantized(name: str) -> bool:
    """Whether weight-only quantization applies to the checkpoint tensor called `name`."""
    return name.endswith(QUANTIZED_SUFFIXES)


def quantize(weight: torch.Tensor, algo: str) -> QuantizedWeight:
    """Symmetric per-output-channel quantization of one rank's `[out, in]` weight."""
    qmax = QMAX[algo]
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # all-zero rows: any scale works
    values = torch.round(w / scale[:, None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return QuantizedWeight(values, scale)


def fake_quantize(weight: torch.Tensor, algo: str, in_chunks: int = 1) -> torch.Tensor:
    """float32 ŵ of `weight` as `in_chunks` ranks holding its column chunks would quantize it."""
    parts = [quantize(part, algo).dequantize(torch.float32) for part in weight.chunk(in_chunks, dim=1)]
    return torch.cat(parts, dim=1)


# --- FP8 -------------------------------------------------------------------------------------------------------------

def fp8_scale(amax: float) -> float:
    """The per-tensor scale that maps `amax` onto the largest FP8 value (1 for an all-zero tensor, as ModelOpt)."""
    return amax / FP8_MAX if amax > 0 else 1.0


def to_fp8(t: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """q(t, scale): t / scale in float8_e4m3fn, saturated at ±448."""
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_quantize_fp8(t: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """q(t, scale) · scale in t's dtype: what an FP8 tensor of that scale gives back."""
    return (to_fp8(t, scale).float() * scale).to(t.dtype)


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """y = (q(x, s_x) · s_x) · (W_q · s_w)ᵀ + b in x's dtype, products in float32 (as the FP8 tensor cores)."""
    w = values.float() * scale
    y = F.linear(to_fp8(x, input_scale).float() * input_scale, w)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@dataclass
class Fp8Weight:
    """An `[out, in]` weight of an FP8 checkpoint: float8_e4m3fn values, their scale and its input's scale (float32
    scalars)."""

    values: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.values.float() * self.scale).to(dtype)

    def to(self, device: str | torch.device) -> "Fp8Weight":
        return Fp8Weight(self.values.to(device), self.scale.to(device), self.input_scale.to(device))

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, self.values, self.scale, self.input_scale, bias)
