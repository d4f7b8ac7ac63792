"""FP8 calibration: the largest magnitude (amax) of each quantized linear's input and weight, and of each layer's keys
and values, over a set of prompts, as the model itself computes them in float32.

The model runs layer by layer and holds one layer's weights at a time (read through `tensor`, a checkpoint tensor by
name, so a converter can stream them from the HF files): every prompt's hidden states go through layer 0, then
through layer 1, and so on. A layer is model.py's `attention_block` and `mlp_block`, the runtime's computation,
with its linears observed as they are applied. The scales follow (runtime/quant.py: amax / 448).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from trtglm.errors import UsageError
from trtglm.runtime.checkpoint import QUANTIZED_LINEARS, CheckpointConfig
from trtglm.runtime.model import LayerWeights, Tensors, attention_block, layer_weights, mlp_block, rotary_tables

log = logging.getLogger(__name__)


@dataclass
class Calibration:
    """amax by linear (`transformer.layers.{l}.attention.qkv`, …) of its input and of its weight, and by layer of
    its keys and values (after rotary: what a KV cache holds); the prompts' token count."""

    inputs: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    kv: dict[int, float] = field(default_factory=dict)
    tokens: int = 0

    def see(self, table: dict, key, values: torch.Tensor) -> None:
        table[key] = max(table.get(key, 0.0), float(values.detach().abs().amax()))


class _Observed:
    """A float linear weight that records the largest input it multiplies."""

    def __init__(self, weight: torch.Tensor, name: str, found: Calibration):
        self.weight, self.name, self.found = weight, name, found
        found.see(found.weights, name, weight)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.found.see(self.found.inputs, self.name, x)
        return F.linear(x, self.weight, bias)


@torch.inference_mode()
def calibrate(cfg: CheckpointConfig, tensor: Tensors, prompts: Sequence[Sequence[int]],
              device: str | torch.device = "cpu") -> Calibration:
    """Run `prompts` (token ids) through the unquantized tp-1 model whose tensors `tensor` gives; see the module
    docstring."""
    if cfg.tp_size != 1 or cfg.quant_algo:
        raise UsageError(f"calibration runs the whole unquantized model (tp 1), not tp {cfg.tp_size} "
                         f"{cfg.quant_algo or ''}".rstrip())
    prompts = [list(p) for p in prompts if len(p)]
    if not prompts:
        raise UsageError("calibration needs at least one prompt with tokens")
    too_long = [len(p) for p in prompts if len(p) > cfg.max_position_embeddings]
    if too_long:
        raise UsageError(f"a calibration prompt has {too_long[0]} tokens; the model takes "
                         f"{cfg.max_position_embeddings}")
    found = Calibration(tokens=sum(map(len, prompts)))
    embedding = tensor("transformer.vocab_embedding.weight").to(device=device, dtype=torch.float32)
    states = [F.embedding(torch.tensor([p], device=device), embedding) for p in prompts]
    del embedding
    ropes = [rotary_tables(cfg, torch.arange(len(p), device=device)[None]) for p in prompts]
    for layer in tqdm(range(cfg.num_layers), desc="calibrate", unit="layer", disable=None, leave=False):
        w = _observed(layer_weights(cfg, tensor, layer, torch.float32, device), layer, found)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = layer) -> torch.Tensor:
            found.see(found.kv, layer, torch.stack((k.abs().amax(), v.abs().amax())))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        for i, (x, rope) in enumerate(zip(states, ropes)):
            x = x + attention_block(cfg, w, x, rope, attend)
            states[i] = x + mlp_block(cfg, w, x)
    log.info("calibrated on %d prompt(s), %d tokens", len(prompts), found.tokens)
    return found


def _observed(w: LayerWeights, layer: int, found: Calibration) -> LayerWeights:
    """`w` with its quantized linears observed."""
    p = f"transformer.layers.{layer}."
    linears = dict(zip(("qkv", "dense", "fc", "proj"), QUANTIZED_LINEARS))
    return LayerWeights(**{**w.__dict__, **{attr: _Observed(getattr(w, attr), p + name, found)
                                            for attr, name in linears.items()}})
