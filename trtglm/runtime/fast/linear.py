"""Linear layers of the fast model: float, weight-only int8 and weight-only int4, and FP8.

The quantization is TensorRT-LLM's (runtime/quant.py: symmetric, one scale per output
channel); only the storage differs, so that a matmul reads fewer bytes:

- int8: `[N, K]` uint8 holding q + 128 (so a byte becomes a half-precision float by placing it
  under a fixed exponent: see kernels.py) and float32 scales;
- int4: `[N, K/2]` uint8 holding q + 8, two to a byte;
- both in kernels.py's planar word order, in which each 32-bit word holds weights of every
  plane of input pairs, so that a kernel reads each plane of the input as one contiguous run.

On CUDA the Triton and Gluon kernels of kernels.py and gluon_gemv.py do the products,
converting weights in registers and applying the scale to the float32 accumulator: one-row
kernels for batch-1 decoding (the bf16 and int8 ones can also apply SwiGLU to their input) and
tensor-core kernels for more rows; prompts may instead dequantize the weights into a buffer
and use cuBLAS, whichever `tune` timed faster. Float weights use cuBLAS except where the
one-row kernel was timed faster. Elsewhere the weights are dequantized and multiplied by
PyTorch.

FP8 (an FP8 checkpoint's weights: float8_e4m3fn `[N, K]`, one scale for the whole weight and a static one for
its input, runtime/quant.py): the input is quantized by one Triton kernel (with SwiGLU applied first, for `proj`),
then PyTorch's scaled matmul multiplies (`torch._scaled_mm`: cuBLASLt's FP8 GEMM, float32 accumulation, both scales
applied to the result, out in the compute dtype or float32). It needs FP8 tensor cores (compute capability 8.9:
Ada, Hopper and later) and input and output features in multiples of 16; `emulate` computes the same function
with float32 matmuls (`quant.fp8_linear`) where there are none, for tests and dry runs on the CPU.

PyTorch's own weight-only ops were measured on an H200 and not used (docs/benchmarks.md):
`_weight_int8pack_mm` is many times slower than bf16 on CUDA; `_weight_int4pack_mm`
(tinygemm) decoded one sequence about 5% faster than these kernels but four times slower at
batch 64, and prefilled ten times slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtglm.runtime.quant import fp8_linear, quantize

FLOAT, INT8, INT4 = 0, 1, 2  # as kernels.FLOAT/INT8/INT4 (kept here so CPU-only code needs no Triton)
FP8 = 3  # float8_e4m3fn weights, FP8 inputs: torch._scaled_mm
KINDS = {None: FLOAT, "W8A16": INT8, "W4A16": INT4}
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


class Linear:
    """y = x · Ŵᵀ + b, Ŵ = stored values × per-row scale (float weights: the stored values)."""

    def __init__(self, stored: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, kind: int,
                 use_triton: bool, input_scale: torch.Tensor | None = None, emulate: bool = False):
        self.stored, self.scale, self.bias, self.kind = stored, scale, bias, kind
        self.use_triton = use_triton
        self.input_scale, self.emulate = input_scale, emulate  # FP8's (`emulate`: float32 matmuls, no FP8 hardware)
        self.tune = False  # time the kernels' block shapes at the first call of each row bucket
        self.tuned_keys: set[tuple] = set()  # kernels.matmul_key of each call tuned

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

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, emulate: bool) -> Linear:
        """The layer for one FP8 checkpoint weight `[N, K]` (float8_e4m3fn) and its scales (on its device)."""
        if not emulate and (weight.shape[0] % 16 or weight.shape[1] % 16):
            raise ValueError(f"FP8 matmuls take multiples of 16 features, not a {list(weight.shape)} weight")
        scale, input_scale = (t.float().reshape(()).contiguous() for t in (scale, input_scale))
        return cls(weight.contiguous(), scale, bias.to(dtype) if bias is not None else None, FP8, False,
                   input_scale, emulate)

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: stored weights and scales."""
        scales = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.stored.numel() * self.stored.element_size() + scales

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == FLOAT:
            return self.stored.to(dtype)
        if self.kind == FP8:
            return (self.stored.float() * self.scale).to(dtype)
        values = unpack_int8(self.stored) if self.kind == INT8 else unpack_int4(self.stored)
        return (values.float() * self.scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, swiglu: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x `[..., K]` → `[..., N]` in out_dtype (default x's); `swiglu`: x holds [up; gate] rows and the input is
        silu(gate) · up."""
        rows = x.reshape(-1, x.shape[-1])
        if self.kind == FP8:
            y = self._fp8(rows, swiglu, out_dtype or x.dtype)
        elif self.use_triton:
            from trtglm.runtime.fast import kernels

            if self.tune:
                self.tuned_keys.add(kernels.tune(rows, self.stored, self.scale, self.bias, self.kind, swiglu))
            y = kernels.matmul(rows, self.stored, self.scale, self.bias, self.kind, swiglu, out_dtype=out_dtype)
        else:
            if swiglu:
                up, gate = rows.float().chunk(2, dim=-1)
                rows = (F.silu(gate) * up).to(x.dtype)
            y = F.linear(rows, self.dequantized(x.dtype), self.bias).to(out_dtype or x.dtype)
        return y.reshape(*x.shape[:-1], -1)

    def _fp8(self, rows: torch.Tensor, swiglu: bool, out_dtype: torch.dtype) -> torch.Tensor:
        if self.emulate:
            if swiglu:
                up, gate = rows.float().chunk(2, dim=-1)
                rows = (F.silu(gate) * up).to(rows.dtype)
            return fp8_linear(rows, self.stored, self.scale, self.input_scale, self.bias).to(out_dtype)
        from trtglm.runtime.fast import kernels

        inputs = kernels.quantize_fp8(rows, self.input_scale, swiglu)
        y = torch._scaled_mm(inputs, self.stored.t(), scale_a=self.input_scale, scale_b=self.scale,
                             out_dtype=out_dtype)
        return y if self.bias is None else y.add_(self.bias)


def fp8_problem(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return f"the {device.type} has no FP8 matmuls"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no FP8 "
                "tensor cores")
    return None


def pack_int8(values: torch.Tensor) -> torch.Tensor:
    """int8 values `[N, K]` → `[N, K]` uint8 holding value + 128 in kernels.py's planar word order: byte 2p + h of
    word c holds feature 2(p·K/4 + c) + h."""
    rows, features = values.shape
    if features % 4:
        raise ValueError(f"int8 packing needs a multiple of 4 input features, not {features}")
    biased = (values.to(torch.int16) + 128).to(torch.uint8)
    return biased.view(rows, 2, features // 4, 2).permute(0, 2, 1, 3).reshape(rows, features).contiguous()


def unpack_int8(stored: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int8`."""
    rows, features = stored.shape
    biased = stored.view(rows, features // 4, 2, 2).permute(0, 2, 1, 3).reshape(rows, features)
    return (biased.to(torch.int16) - 128).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values `[N, K]` (−8..7 in int8 storage) → `[N, K/2]` uint8 holding value + 8 in kernels.py's planar word
    order: the nibble at bits 4p + 16h of word c holds feature 2(p·K/8 + c) + h, so byte 2h + p//2 of the word
    holds planes 2·(p//2) (low nibble) and 2·(p//2) + 1 (high nibble)."""
    rows, features = values.shape
    if features % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 input features, not {features}")
    biased = (values.to(torch.int16) + 8).to(torch.uint8).view(rows, 2, 2, features // 8, 2)  # [row, p//2, p%2, c, h]
    packed = biased[:, :, 0] | (biased[:, :, 1] << 4)  # [row, p//2, c, h]
    return packed.permute(0, 2, 3, 1).reshape(rows, features // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: `[N, K]` int8 values."""
    rows, features = packed.shape[0], 2 * packed.shape[1]
    pairs = packed.view(rows, features // 8, 2, 2)  # [row, c, h, p//2]
    nibbles = torch.stack((pairs & 15, pairs >> 4), dim=-1)  # [row, c, h, p//2, p%2]
    values = nibbles.permute(0, 3, 4, 1, 2).reshape(rows, features)
    return values.to(torch.int8) - 8
