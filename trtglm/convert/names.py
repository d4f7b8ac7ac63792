"""The one table from ChatGLM HF tensor names to TensorRT-LLM checkpoint names.

Each row: HF name, TensorRT-LLM name (`{layer}` for per-layer tensors), the split rule
(trtglm.convert.split.RULES) and the expected HF shape; `quantized` marks the linear weights that
FP8 (and TensorRT-LLM's weight-only modes) quantize. Per-layer rows are expanded for every layer,
in table order, between the rows before and after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby

from trtglm.chatglm.config import ChatGLMConfig

HF_LAYER = "transformer.encoder.layers.{layer}."
TRT_LAYER = "transformer.layers.{layer}."


@dataclass(frozen=True)
class TensorName:
    hf: str
    trt: str
    rule: str
    shape: Callable[[ChatGLMConfig], tuple[int, ...]]
    only_if: str | None = None  # a ChatGLMConfig flag that must be true for the tensor to exist
    quantized: bool = False

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf


def _attn_width(c: ChatGLMConfig) -> int:
    return c.num_heads * c.head_dim


TABLE: tuple[TensorName, ...] = (
    TensorName("transformer.embedding.word_embeddings.weight", "transformer.vocab_embedding.weight", "whole",
               lambda c: (c.vocab_size, c.hidden_size)),
    TensorName(HF_LAYER + "input_layernorm.weight", TRT_LAYER + "input_layernorm.weight", "whole",
               lambda c: (c.hidden_size,)),
    TensorName(HF_LAYER + "self_attention.query_key_value.weight", TRT_LAYER + "attention.qkv.weight", "qkv",
               lambda c: (c.qkv_rows, c.hidden_size), quantized=True),
    TensorName(HF_LAYER + "self_attention.query_key_value.bias", TRT_LAYER + "attention.qkv.bias", "qkv",
               lambda c: (c.qkv_rows,), only_if="add_qkv_bias"),
    TensorName(HF_LAYER + "self_attention.dense.weight", TRT_LAYER + "attention.dense.weight", "cols",
               lambda c: (c.hidden_size, _attn_width(c)), quantized=True),
    TensorName(HF_LAYER + "post_attention_layernorm.weight", TRT_LAYER + "post_layernorm.weight", "whole",
               lambda c: (c.hidden_size,)),
    TensorName(HF_LAYER + "mlp.dense_h_to_4h.weight", TRT_LAYER + "mlp.fc.weight", "swap_gate_up",
               lambda c: (2 * c.ffn_hidden_size, c.hidden_size), quantized=True),
    TensorName(HF_LAYER + "mlp.dense_4h_to_h.weight", TRT_LAYER + "mlp.proj.weight", "cols",
               lambda c: (c.hidden_size, c.ffn_hidden_size), quantized=True),
    TensorName("transformer.encoder.final_layernorm.weight", "transformer.ln_f.weight", "whole",
               lambda c: (c.hidden_size,)),
    TensorName("transformer.output_layer.weight", "lm_head.weight", "rows",
               lambda c: (c.vocab_size, c.hidden_size)),
)

# HF tensors that are expected but not converted (TensorRT-LLM computes rotary frequencies itself).
DROPPED: tuple[str, ...] = ("transformer.rotary_pos_emb.inv_freq",)


@dataclass(frozen=True)
class MappedTensor:
    """One concrete tensor of a model: both names, split rule and expected HF shape."""

    hf: str
    trt: str
    rule: str
    shape: tuple[int, ...]
    quantized: bool = False


def mapped_tensors(cfg: ChatGLMConfig) -> list[MappedTensor]:
    """Every tensor the model with config `cfg` has, in checkpoint order."""
    rows = [row for row in TABLE if row.only_if is None or getattr(cfg, row.only_if)]
    out: list[MappedTensor] = []
    for per_layer, group in groupby(rows, key=lambda row: row.per_layer):
        group = list(group)
        for layer in range(cfg.num_layers) if per_layer else (None,):
            out.extend(MappedTensor(row.hf.format(layer=layer), row.trt.format(layer=layer), row.rule, row.shape(cfg),
                                    row.quantized) for row in group)
    return out
