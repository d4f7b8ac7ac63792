"""Linear layers of the fast model: float, weight-only int8 and weight-only int4.

The quantization is TensorRT-LLM's (runtime/quant.py: symmetric, one scale per output
channel); only the storage differs, so that a matmul reads fewer bytes:

- int8: `[N, K]` uint8 holding q + 128 (so a byte becomes a half-precision float by placing it
  under a fixed exponent: see kernels.py) and float32 scales;
- int4: `[N, K/2]` uint8, byte j of a row holding q[j] + 8 in its low nibble and q[j + K/2] + 8
  in its high nibble (so each half of the input row meets contiguous bytes).

On CUDA the Triton kernels of kernels.py do the products, converting weights in registers
and applying the scale to the float32 accumulator: a one-row kernel for batch-1 decoding
(which can also apply SwiGLU to its input) and a tensor-core kernel for more rows. Float
weights use cuBLAS except where the one-row kernel was timed faster (`tune`). Elsewhere the
weights are dequantized and multiplied by PyTorch.

PyTorch's own weight-only ops were measured on an H200 and not used (docs/benchmarks.md):
`_weight_int8pack_mm` is many times slower than bf16 on CUDA; `_weight_int4pack_mm`
(tinygemm) decoded one sequence about 5% faster than these kernels but four times slower at
batch 64, and prefilled ten times slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtglm.runtime.quant import quantize

FLOAT, INT8, INT4 = 0, 1, 2  # as kernels.FLOAT/INT8/INT4 (kept here so CPU-only code needs no Triton)
KINDS = {None: FLOAT, "W8A16": INT8, "W4A16": INT4}


class Linear:
    """y = x · Ŵᵀ + b, Ŵ = stored values × per-row scale (float weights: the stored values)."""

    def __init__(self, stored: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, kind: int,
                 use_triton: bool):
        self.stored, self.scale, self.bias, self.kind = stored, scale, bias, kind
        self.use_triton = use_triton
        self.tune = False  # time the kernels' block shapes at the first call of each row bucket

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant_algo: str | None,
                    dtype: torch.dtype, use_triton: bool) -> Linear:
        """The layer for one checkpoint weight `[N, K]` (already on its device, in the checkpoint's dtype)."""
        bias = bias.to(dtype) if bias is not None else None
        kind = KINDS[quant_algo]
        if kind == FLOAT:
            return cls(weight.to(dtype).contiguous(), None, bias, kind, use_triton)
        q = quantize(weight, quant_algo)
        stored = pack_int8(q.values) if kind == INT8 else pack_int4(q.values)
        return cls(stored, q.scale.contiguous(), bias, kind, use_triton)

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: stored weights and scales."""
        scales = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.stored.numel() * self.stored.element_size() + scales

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == FLOAT:
            return self.stored.to(dtype)
        values = unpack_int8(self.stored) if self.kind == INT8 else unpack_int4(self.stored)
        return (values.float() * self.scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """x `[..., K]` → `[..., N]`; `swiglu`: x holds [up; gate] rows and the input is silu(gate) · up."""
        rows = x.reshape(-1, x.shape[-1])
        if self.use_triton:
            from trtglm.runtime.fast import kernels

            if self.tune:
                kernels.tune(rows, self.stored, self.scale, self.bias, self.kind, swiglu)
            y = kernels.matmul(rows, self.stored, self.scale, self.bias, self.kind, swiglu)
        else:
            if swiglu:
                up, gate = rows.float().chunk(2, dim=-1)
                rows = (F.silu(gate) * up).to(x.dtype)
            y = F.linear(rows, self.dequantized(x.dtype), self.bias)
        return y.reshape(*x.shape[:-1], -1)


def pack_int8(values: torch.Tensor) -> torch.Tensor:
    """int8 values `[N, K]` → `[N, K]` uint8 holding value + 128."""
    return (values.to(torch.int16) + 128).to(torch.uint8).contiguous()


def unpack_int8(stored: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int8`."""
    return (stored.to(torch.int16) - 128).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values `[N, K]` (−8..7 in int8 storage) → `[N, K/2]` uint8 (the layout described above)."""
    if values.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of input features, not {values.shape[-1]}")
    biased = (values.to(torch.int16) + 8).to(torch.uint8)
    low, high = biased.chunk(2, dim=-1)
    return (low | (high << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: `[N, K]` int8 values."""
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.cat((low, high), dim=-1)
