"""Command lines built from a profile: pure functions returning argv lists (shell-quote to print).

- `convert_argv`: the `trtglm convert` call that makes the TensorRT-LLM checkpoint;
- `trtllm_build_argv`: current TensorRT-LLM's `trtllm-build` (checkpoint → engine);
- `trtllm07_build_argv`: TensorRT-LLM v0.7.1's `examples/chatglm/build.py` (HF folder → engine
  in one step, no checkpoint), for Triton containers of that generation.
"""

from __future__ import annotations

from trtglm.errors import UsageError
from trtglm.profile import Profile

TRTLLM_BUILD = "trtllm-build"
TRTLLM07_SCRIPT = "examples/chatglm/build.py"
V07_MIN_TOKENS_PER_BLOCK_WITH_FMHA = 128  # v0.7.1 build.py asserts it


def _switch(on: bool) -> str:
    return "enable" if on else "disable"


def convert_argv(profile: Profile, model_dir: str, checkpoint_dir: str, force: bool = True) -> list[str]:
    """`trtglm convert ...` with the profile's conversion settings."""
    c = profile.convert
    argv = ["trtglm", "convert", "--model-dir", str(model_dir), "--output-dir", str(checkpoint_dir),
            "--dtype", c.dtype, "--tp-size", str(c.tp_size), "--pp-size", str(c.pp_size)]
    if c.weight_only:
        argv += ["--weight-only", c.weight_only]
    if c.fp8:
        argv += ["--fp8", *(["--fp8-kv-cache"] if c.fp8_kv_cache else []),
                 *(["--calibration-prompts", c.calibration_prompts] if c.calibration_prompts else [])]
    argv += ["--chatglm-version", profile.chatglm_version]
    return argv + (["--force"] if force else [])


def trtllm_build_argv(profile: Profile, checkpoint_dir: str, output_dir: str) -> list[str]:
    """`trtllm-build` for the profile's limits and features (weight-only and FP8 come from the checkpoint's
    quantization, as in TensorRT-LLM's examples/chatglm README: `trtllm-build --checkpoint_dir <FP8 checkpoint> …`)."""
    b = profile.build
    return [
        TRTLLM_BUILD,
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(b.max_input_len),
        "--max_seq_len", str(b.max_seq_len),
        "--max_num_tokens", str(b.max_num_tokens),
        "--max_beam_width", str(b.max_beam_width),
        "--kv_cache_type", b.kv_cache_type,
        "--gemm_plugin", b.gemm_plugin,
        "--gpt_attention_plugin", b.gpt_attention_plugin,
        "--context_fmha", _switch(b.context_fmha),
        "--remove_input_padding", _switch(b.remove_input_padding),
        "--use_paged_context_fmha", _switch(b.use_paged_context_fmha),
        "--tokens_per_block", str(b.tokens_per_block),
    ]


def trtllm07_build_argv(profile: Profile, model_dir: str, output_dir: str,
                        script: str = TRTLLM07_SCRIPT) -> list[str]:
    """TensorRT-LLM v0.7.1 `python3 examples/chatglm/build.py ...` (run from the TensorRT-LLM tree)."""
    c, b, where = profile.convert, profile.build, f"{profile.path}: --target trtllm-0.7"
    model_name = profile.variant.trtllm07_name
    if model_name is None:
        raise UsageError(f"{where}: TensorRT-LLM v0.7.1 has no build for {profile.model.variant}")
    if c.weight_only and c.dtype != "float16":
        raise UsageError(f"{where}: v0.7.1's weight-only plugin is float16 only; convert.dtype is {c.dtype}")
    if c.fp8:
        raise UsageError(f"{where}: v0.7.1's build.py reads FP8 scales only from an AMMO-quantized .npz "
                         "(--quantized_fp8_model_path), which trtglm does not write; build FP8 with --target current")
    if b.context_fmha and b.kv_cache_type == "paged" and b.tokens_per_block < V07_MIN_TOKENS_PER_BLOCK_WITH_FMHA:
        raise UsageError(f"{where}: v0.7.1 needs build.tokens_per_block ≥ {V07_MIN_TOKENS_PER_BLOCK_WITH_FMHA} "
                         f"with context FMHA, not {b.tokens_per_block}")
    argv = ["python3", script, "-m", model_name, "--model_dir", str(model_dir),
            "--world_size", str(profile.world_size), "--tp_size", str(c.tp_size), "--dtype", c.dtype,
            "--use_gpt_attention_plugin", _v07_plugin(b.gpt_attention_plugin, c.dtype, "gpt_attention_plugin", where),
            "--use_gemm_plugin", _v07_plugin(b.gemm_plugin, c.dtype, "gemm_plugin", where)]
    if c.weight_only:
        argv += ["--use_weight_only", "--weight_only_precision", c.weight_only]
    if profile.serve.batching_strategy == "inflight_fused_batching":
        argv.append("--use_inflight_batching")
    if b.kv_cache_type == "paged":
        argv += ["--paged_kv_cache", "--tokens_per_block", str(b.tokens_per_block)]
    if b.remove_input_padding:
        argv.append("--remove_input_padding")
    if b.context_fmha:
        argv.append("--enable_context_fmha")
    return argv + ["--max_batch_size", str(b.max_batch_size), "--max_input_len", str(b.max_input_len),
                   "--max_output_len", str(b.max_seq_len - b.max_input_len),
                   "--max_beam_width", str(b.max_beam_width), "--output_dir", str(output_dir)]


def _v07_plugin(value: str, dtype: str, key: str, where: str) -> str:
    """v0.7.1 takes a plugin's data type; its flags cannot turn a plugin off (argparse choices)."""
    if value == "disable":
        raise UsageError(f"{where}: v0.7.1's build.py cannot disable the plugin; set build.{key} to auto or a dtype")
    return dtype if value == "auto" else value
