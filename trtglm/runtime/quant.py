"""Weight-only quantization (W8A16 / W4A16) as TensorRT-LLM applies it to a float checkpoint.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
