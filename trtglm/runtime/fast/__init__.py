"""The fast single-GPU runtime: `FastModel`, a `SlotModel` with a static KV cache, CUDA-graph decode
steps, Triton kernels between the matmuls and weight-only int8/int4 matmuls."""

from trtglm.runtime.fast.model import FastModel, batch_buckets, load_fast_model

__all__ = ["FastModel", "batch_buckets", "load_fast_model"]
