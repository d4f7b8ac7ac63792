"""`convert`, `verify`, `synth-model`: HF weights → TensorRT-LLM checkpoint, and checking it."""

from __future__ import annotations

from typing import Literal

from trtglm.chatglm.config import TP_SIZES
from trtglm.cli.flags import CountInt, PosFloat, PosInt


def convert(model_dir: str, output_dir: str, dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto",
            tp_size: Literal[TP_SIZES] = 1, pp_size: PosInt = 1, weight_only: Literal["int8", "int4"] | None = None,
            fp8: bool = False, fp8_kv_cache: bool = False, calibration_prompts: str | None = None,
            chatglm_version: Literal["auto", "chatglm3", "chatglm2"] = "auto", force: bool = False):
    """ChatGLM HF weights -> TensorRT-LLM checkpoint (config.json + rank{r}.safetensors).

    --fp8: FP8 weights and activations (quant_algo FP8, for Hopper and Ada GPUs), their scales calibrated on
    --calibration-prompts FILE (one prompt a line, or JSONL chats; default: trtglm's own set); --fp8-kv-cache: the
    KV cache in FP8 too.
    """
    from trtglm.convert.writer import convert_checkpoint

    convert_checkpoint(model_dir, output_dir, dtype=dtype, tp_size=tp_size, pp_size=pp_size,
                       weight_only=weight_only, fp8=fp8, fp8_kv_cache=fp8_kv_cache,
                       calibration_prompts=calibration_prompts, chatglm_version=chatglm_version, force=force)


def verify(checkpoint: str, hf_model: str, prompts: str | None = None, max_tokens: PosInt = 16,
           device: str = "cpu"):
    """Compare a TensorRT-LLM checkpoint, run by trtglm's runtime, with transformers' GlmForCausalLM."""
    from trtglm.runtime.verify import verify_checkpoint

    verify_checkpoint(checkpoint, hf_model, prompts=prompts, max_tokens=max_tokens, device=device)


def synth_model(preset: Literal["tiny", "6b", "6b-32k"], out: str, layers: PosInt | None = None,
                format: Literal["safetensors", "bin"] = "safetensors",
                dtype: Literal["float16", "bfloat16", "float32"] = "float16", seed: CountInt = 0, force: bool = False):
    """Random-weight ChatGLM3 checkpoint with the real HF layout and shapes (tiny, 6b, 6b-32k)."""
    from trtglm.convert.synth import synth_model as run

    run(preset, out, layers=layers, fmt=format, dtype=dtype, seed=seed, force=force)
