"""FP8 conversion (quant_algo FP8): calibration on prompts, then the scales and FP8 weights of a TensorRT-LLM
checkpoint in NVIDIA's layout, as TensorRT-LLM's `examples/quantization/quantize.py --qformat fp8 [--kv_cache_dtype
fp8]` (ModelOpt) writes it:

- `config.json` quantization: `{"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" or null}`;
- each quantized linear (`attention.qkv`, `attention.dense`, `mlp.fc`, `mlp.proj` of every layer): `weight` in
  float8_e4m3fn, `weights_scaling_factor` = amax(W) / 448 and `activation_scaling_factor` = amax(input) / 448 from
  calibration, both float32 of shape [1] (TensorRT-LLM's FP8Linear parameters, tensorrt_llm/quantization/layers.py;
  ModelOpt exports a per-tensor amax as shape [1], "tensorrt_llm assumes the scaling_factor dim >= 1 for per-tensor",
  modelopt/torch/quantization/nn/modules/tensor_quantizer.py `export_amax`, and divides it by 448,
  modelopt/torch/export/quant_utils.py `get_scaling_factor`). A scale is the whole (unsplit) tensor's, so every
  tensor-parallel rank holds the same one;
- with an FP8 KV cache, per layer `attention.kv_cache_scaling_factor` (float32 [1], TensorRT-LLM's Attention
  parameter) = max(amax(keys, values) / 448, 1): ModelOpt's `get_kv_cache_scaling_factor` takes at least 1;
- embedding, norms, qkv bias and lm_head stay in the checkpoint dtype (TensorRT-LLM's `quantize_layers` leaves
  `*lm_head` and `*vocab_embedding` out).

Calibration runs the unquantized model over the prompts in float32 (runtime/calibrate.py) with the weights as
rounded to the checkpoint dtype, one layer's weights read at a time: by default trtglm's own prompts
(calibration_prompts.txt: Chinese and English chat, code, arithmetic), else the user's prompt file (as `trtglm
verify --prompts` reads one), in the model's chat format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from trtglm.chatglm.prompt_file import read_prompt_ids
from trtglm.conventions import INPUT_SCALE, KV_SCALE, WEIGHT_SCALE
from trtglm.runtime.calibrate import Calibration, calibrate
from trtglm.runtime.checkpoint import CheckpointConfig
from trtglm.runtime.quant import fp8_scale, to_fp8

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = Path(__file__).with_name("calibration_prompts.txt")
PROMPTS_FLAG = "--calibration-prompts"
KV_SCALE_FLOOR = 1.0  # ModelOpt's least FP8 KV-cache scale
Scales = dict[str, float]  # checkpoint tensor name -> its scale


def calibration_prompt_ids(prompts: str | Path | None, model_dir: str | Path, version: str) -> list[list[int]]:
    """The calibration prompts (None: trtglm's own) as prompt ids, encoded by the model folder's tokenizer."""
    path = DEFAULT_PROMPTS if prompts is None else Path(prompts)
    ids = read_prompt_ids(path, model_dir, PROMPTS_FLAG, version)
    log.info("FP8 calibration prompts: %s (%d prompts, %d tokens)", path, len(ids), sum(map(len, ids)))
    return ids


def calibrated_scales(cfg: CheckpointConfig, tensor: Callable[[str], torch.Tensor], prompts: list[list[int]],
                      kv_cache: bool, device: torch.device) -> Scales:
    """Every scale an FP8 checkpoint holds (see the module docstring), from a calibration over `prompts` of the
    unquantized model of tp-1 config `cfg` whose tensors `tensor` gives by name (in the checkpoint dtype)."""
    return scales(calibrate(cfg, tensor, prompts, device), kv_cache)


def scales(found: Calibration, kv_cache: bool) -> Scales:
    weights = {f"{linear}.{WEIGHT_SCALE}": fp8_scale(amax) for linear, amax in found.weights.items()}
    inputs = {f"{linear}.{INPUT_SCALE}": fp8_scale(amax) for linear, amax in found.inputs.items()}
    kv = {f"transformer.layers.{layer}.attention.{KV_SCALE}": max(fp8_scale(amax), KV_SCALE_FLOOR)
          for layer, amax in found.kv.items()} if kv_cache else {}
    return {**weights, **inputs, **kv}


def weight_scale(scales: Scales, weight: str) -> float:
    """The scale of the quantized weight tensor `weight` (`….weight`)."""
    return scales[f"{weight.removesuffix('.weight')}.{WEIGHT_SCALE}"]


def scale_tensor(value: float) -> torch.Tensor:
    """A scale as the checkpoint holds it: float32 of shape [1]."""
    return torch.tensor([value], dtype=torch.float32)


def quantize_weight(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of a weight (in the checkpoint dtype) as float8_e4m3fn at the weight's scale."""
    return to_fp8(rows, scale)


def fp8_rank_tensors(tensors: dict[str, torch.Tensor], scales: Scales) -> dict[str, torch.Tensor]:
    """One rank's tensors of an unquantized checkpoint (as `convert` would write them) made an FP8 checkpoint's:
    the quantized weights in FP8 and every scale added (for checkpoints made in memory: the benchmarks, tests)."""
    out = dict(tensors)
    for name in tensors:
        prefix = name.removesuffix(".weight")
        if f"{prefix}.{WEIGHT_SCALE}" in scales:
            out[name] = quantize_weight(tensors[name], weight_scale(scales, name))
    device = next(iter(tensors.values())).device
    return out | {name: scale_tensor(value).to(device) for name, value in scales.items()}
