"""The fast GPU runtime: `FastModel`, a `SlotModel` with a paged KV cache, CUDA-graph decode steps,
Triton kernels between the matmuls and weight-only int8/int4 matmuls (model.py; passes.py: its forward
passes; graphs.py: its warm-up and CUDA graphs; shapes.py: its checked options, graph sizes and prefill
groups), one GPU per rank of a tensor-parallel checkpoint (parallel.py:
the all-reduces and the logits' gather)."""

from trtglm.runtime.fast.model import FastModel, load_fast_model
from trtglm.runtime.fast.shapes import batch_buckets

__all__ = ["FastModel", "batch_buckets", "load_fast_model"]
