"""Command lines built from the shipped profiles, as exact lists (trtllm.md §2 gives the flags)."""

import pytest

from conftest import REPO
from trtglm.engine.manifest import Limits
from trtglm.engine.trtllm_cmd import convert_argv, trtllm07_build_argv, trtllm_build_argv
from trtglm.errors import UsageError
from trtglm.profile import load_profile, parse_overrides

CONFIGS = REPO / "configs"


def profile(name, **overrides):
    return load_profile(CONFIGS / f"{name}.yaml", overrides or None)


# name -> expected `trtllm-build` argv for checkpoint E/checkpoint and output E
TRTLLM_BUILD = {
    "chatglm3-6b-fp16-tp1": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "64",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-bf16-tp1": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "64",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-int8-tp1": [  # weight-only comes from the checkpoint's quant_algo, not from a flag
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "64",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-int4-tp1": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "64",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-fp16-tp2": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "128",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-fp16-tp4": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "256",
        "--max_input_len", "4096", "--max_seq_len", "8192", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-32k-fp16-tp1": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "2",
        "--max_input_len", "30720", "--max_seq_len", "32768", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
    "chatglm3-6b-128k-fp16-tp1": [
        "trtllm-build", "--checkpoint_dir", "E/checkpoint", "--output_dir", "E", "--max_batch_size", "4",
        "--max_input_len", "126976", "--max_seq_len", "131072", "--max_num_tokens", "8192", "--max_beam_width", "1",
        "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
        "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "enable",
        "--tokens_per_block", "128"],
}
NOT_IN_TRTLLM07 = {"chatglm3-6b-128k-fp16-tp1", "chatglm3-6b-fp8-tp1"}  # v0.7.1's build.py has no such model, and
# takes FP8 only from an AMMO .npz
# FP8 comes from the checkpoint (TensorRT-LLM's examples/chatglm README builds its FP8 checkpoint with no FP8 flag)
TRTLLM_BUILD["chatglm3-6b-fp8-tp1"] = TRTLLM_BUILD["chatglm3-6b-bf16-tp1"]

# name -> expected v0.7.1 `examples/chatglm/build.py` argv for HF folder /m and output E
TRTLLM07 = {
    "chatglm3-6b-fp16-tp1": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "1",
        "--tp_size", "1", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128",
        "--remove_input_padding", "--enable_context_fmha", "--max_batch_size", "64", "--max_input_len", "4096",
        "--max_output_len", "4096", "--max_beam_width", "1", "--output_dir", "E"],
    "chatglm3-6b-bf16-tp1": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "1",
        "--tp_size", "1", "--dtype", "bfloat16", "--use_gpt_attention_plugin", "bfloat16", "--use_gemm_plugin",
        "bfloat16", "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128",
        "--remove_input_padding", "--enable_context_fmha", "--max_batch_size", "64", "--max_input_len", "4096",
        "--max_output_len", "4096", "--max_beam_width", "1", "--output_dir", "E"],
    "chatglm3-6b-int8-tp1": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "1",
        "--tp_size", "1", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_weight_only", "--weight_only_precision", "int8", "--use_inflight_batching",
        "--paged_kv_cache", "--tokens_per_block", "128", "--remove_input_padding", "--enable_context_fmha",
        "--max_batch_size", "64", "--max_input_len", "4096", "--max_output_len", "4096", "--max_beam_width", "1",
        "--output_dir", "E"],
    "chatglm3-6b-int4-tp1": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "1",
        "--tp_size", "1", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_weight_only", "--weight_only_precision", "int4", "--use_inflight_batching",
        "--paged_kv_cache", "--tokens_per_block", "128", "--remove_input_padding", "--enable_context_fmha",
        "--max_batch_size", "64", "--max_input_len", "4096", "--max_output_len", "4096", "--max_beam_width", "1",
        "--output_dir", "E"],
    "chatglm3-6b-fp16-tp2": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "2",
        "--tp_size", "2", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128",
        "--remove_input_padding", "--enable_context_fmha", "--max_batch_size", "128", "--max_input_len", "4096",
        "--max_output_len", "4096", "--max_beam_width", "1", "--output_dir", "E"],
    "chatglm3-6b-fp16-tp4": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/m", "--world_size", "4",
        "--tp_size", "4", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128",
        "--remove_input_padding", "--enable_context_fmha", "--max_batch_size", "256", "--max_input_len", "4096",
        "--max_output_len", "4096", "--max_beam_width", "1", "--output_dir", "E"],
    "chatglm3-6b-32k-fp16-tp1": [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b_32k", "--model_dir", "/m", "--world_size", "1",
        "--tp_size", "1", "--dtype", "float16", "--use_gpt_attention_plugin", "float16", "--use_gemm_plugin",
        "float16", "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128",
        "--remove_input_padding", "--enable_context_fmha", "--max_batch_size", "2", "--max_input_len", "30720",
        "--max_output_len", "2048", "--max_beam_width", "1", "--output_dir", "E"],
}


def test_every_tensorrt_profile_has_expected_lists():
    tensorrt = {p.stem for p in CONFIGS.glob("*.yaml") if load_profile(p).build.engine in ("tensorrt", "auto")}
    assert tensorrt == set(TRTLLM_BUILD) == set(TRTLLM07) | NOT_IN_TRTLLM07


@pytest.mark.parametrize("name, message", [
    ("chatglm3-6b-128k-fp16-tp1", "TensorRT-LLM v0.7.1 has no build for chatglm3-6b-128k"),
    ("chatglm3-6b-fp8-tp1", "v0.7.1's build.py reads FP8 scales only from an AMMO-quantized .npz"),
])
def test_trtllm07_has_no_build_for_later_models(name, message):
    assert name in NOT_IN_TRTLLM07
    with pytest.raises(UsageError, match=message):
        trtllm07_build_argv(profile(name), "/m", "E")


@pytest.mark.parametrize("name", TRTLLM_BUILD)
def test_trtllm_build_argv(name):
    assert trtllm_build_argv(profile(name), "E/checkpoint", "E") == TRTLLM_BUILD[name]


@pytest.mark.parametrize("name", TRTLLM07)
def test_trtllm07_build_argv(name):
    assert trtllm07_build_argv(profile(name), "/m", "E") == TRTLLM07[name]


def test_trtllm_build_switches_follow_the_profile():
    p = profile("chatglm3-6b-fp16-tp1", **{"build.context_fmha": False, "build.use_paged_context_fmha": False,
                                           "build.gemm_plugin": "disable", "build.max_beam_width": 2})
    argv = trtllm_build_argv(p, "c", "o")
    pairs = dict(zip(argv[1::2], argv[2::2]))
    assert pairs["--context_fmha"] == "disable" and pairs["--use_paged_context_fmha"] == "disable"
    assert pairs["--gemm_plugin"] == "disable" and pairs["--max_beam_width"] == "2"


def test_engine_limits():
    assert Limits.of(profile("chatglm3-6b-32k-fp16-tp1").build) == Limits(
        max_batch_size=2, max_input_len=30720, max_seq_len=32768, max_num_tokens=8192, max_beam_width=1)


def test_convert_argv():
    assert convert_argv(profile("chatglm3-6b-int4-tp1"), "/m", "E/checkpoint") == [
        "trtglm", "convert", "--model-dir", "/m", "--output-dir", "E/checkpoint", "--dtype", "float16",
        "--tp-size", "1", "--pp-size", "1", "--weight-only", "int4", "--chatglm-version", "chatglm3", "--force"]
    assert convert_argv(profile("chatglm3-6b-fp16-tp2"), "/m", "c", force=False) == [
        "trtglm", "convert", "--model-dir", "/m", "--output-dir", "c", "--dtype", "float16",
        "--tp-size", "2", "--pp-size", "1", "--chatglm-version", "chatglm3"]
    chatglm2 = profile("chatglm3-6b-fp16-tp1", **{"model.variant": "chatglm2-6b"})
    assert convert_argv(chatglm2, "/m", "c")[-3:] == ["--chatglm-version", "chatglm2", "--force"]
    assert convert_argv(profile("chatglm3-6b-fp8-tp1"), "/m", "c", force=False) == [
        "trtglm", "convert", "--model-dir", "/m", "--output-dir", "c", "--dtype", "bfloat16",
        "--tp-size", "1", "--pp-size", "1", "--fp8", "--fp8-kv-cache", "--chatglm-version", "chatglm3"]
    prompts = profile("chatglm3-6b-fp8-tp1", **{"convert.fp8_kv_cache": False, "convert.calibration_prompts": "/p.txt"})
    assert convert_argv(prompts, "/m", "c")[-6:] == ["--fp8", "--calibration-prompts", "/p.txt", "--chatglm-version",
                                                    "chatglm3", "--force"]


@pytest.mark.parametrize("overrides, message", [
    ({"model.variant": "chatglm3-6b-128k"}, "v0.7.1 has no build for chatglm3-6b-128k"),
    ({"convert.dtype": "bfloat16", "convert.weight_only": "int8"}, "weight-only plugin is float16 only"),
    ({"build.tokens_per_block": 64}, "needs build.tokens_per_block ≥ 128 with context FMHA, not 64"),
    ({"build.gemm_plugin": "disable"}, "cannot disable the plugin; set build.gemm_plugin"),
])
def test_trtllm07_refuses_what_v071_cannot_build(overrides, message):
    with pytest.raises(UsageError, match=message):
        trtllm07_build_argv(profile("chatglm3-6b-fp16-tp1", **overrides), "/m", "E")


def test_trtllm07_v1_batching_and_continuous_cache():
    p = profile("chatglm3-6b-fp16-tp1", **{"serve.batching_strategy": "v1", "build.kv_cache_type": "continuous",
                                           "build.use_paged_context_fmha": False, "build.gemm_plugin": "float32"})
    argv = trtllm07_build_argv(p, "/m", "E")
    assert "--use_inflight_batching" not in argv and "--paged_kv_cache" not in argv
    assert "--tokens_per_block" not in argv and argv[argv.index("--use_gemm_plugin") + 1] == "float32"


def test_set_flags_become_overrides():
    assert parse_overrides(["build.max_batch_size=4", "model.dir=/a,b/c", "serve.decoupled=false"]) == {
        "build.max_batch_size": 4, "model.dir": "/a,b/c", "serve.decoupled": False}
    assert parse_overrides(("convert.tp_size=2", "serve.world_size=2")) == {"convert.tp_size": 2, "serve.world_size": 2}
    assert parse_overrides(None) == {}
