"""`plan`: memory figures against published numbers, transformers' parameter count and real checkpoints."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import REPO, run_cli
from support.cli_calls import plan
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.engine.plan import SHAPES_6B, footprint, kv_bytes_per_token, memory_plan, parse_memory, weight_bytes
from trtglm.errors import ModelFileError, UsageError
from trtglm.profile import load_profile

CONFIGS = REPO / "configs"
FP16_TP1 = CONFIGS / "chatglm3-6b-fp16-tp1.yaml"
GiB = 1 << 30

# chatglm3.md: THUDM's "min GPU memory, encode 2048 tokens" for the 6B model, in GB
PUBLISHED_ENCODE_2048 = {None: 13.1e9, "int8": 8.2e9, "int4": 5.5e9}


def glm_6b_parameters() -> dict[str, tuple[int, ...]]:
    """transformers' GlmForCausalLM for ChatGLM3-6B (built on the meta device): name -> shape."""
    from transformers import GlmForCausalLM

    from trtglm.chatglm.reference import glm_config

    cfg = ChatGLMConfig("chatglm3", 28, 4096, 32, 2, 128, 13696, 65024, 8192)
    with torch.device("meta"):
        model = GlmForCausalLM(glm_config(cfg))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("weight_only", PUBLISHED_ENCODE_2048)
def test_total_for_a_2048_token_prompt_matches_the_published_table(weight_only):
    # the total (weights + KV of 2048 tokens + activations + fixed overhead), batch 1
    total = footprint(SHAPES_6B, "float16", weight_only, tp=1, tokens=2048, batch_size=1)
    published = PUBLISHED_ENCODE_2048[weight_only]
    assert abs(total - published) / published <= 0.15, (weight_only, total / 1e9)


def test_fp16_weights_equal_transformers_parameter_count():
    params = glm_6b_parameters()
    total = sum(torch.Size(shape).numel() for shape in params.values())
    assert weight_bytes(SHAPES_6B, "float16") == 2 * total
    assert weight_bytes(SHAPES_6B, "float32") == 4 * total
    # shared/reference/gpu.md: "6.24 B parameters = 12.49 GB of weights" (bf16)
    assert round(weight_bytes(SHAPES_6B, "bfloat16") / 1e9, 2) == 12.49


def test_fp8_bytes_follow_transformers_linear_layers():
    """FP8: a byte per linear weight, one scale per matrix (a few bytes, left out); the KV cache a byte per value."""
    params = glm_6b_parameters()
    numel = sum(s[0] * s[1] for n, s in params.items() if n.endswith("_proj.weight"))
    assert weight_bytes(SHAPES_6B, "bfloat16", "fp8") == weight_bytes(SHAPES_6B, "bfloat16") - numel
    assert 0.54 < weight_bytes(SHAPES_6B, "bfloat16", "fp8") / weight_bytes(SHAPES_6B, "bfloat16") < 0.55
    assert kv_bytes_per_token(SHAPES_6B, "bfloat16", fp8=True) * 2 == kv_bytes_per_token(SHAPES_6B, "bfloat16") == \
        2 * 28 * 2 * 128 * 2  # chatglm3.md: 28,672 bytes per token in 16-bit


@pytest.mark.parametrize("weight_only, bits", [("int8", 8), ("int4", 4)])
def test_weight_only_bytes_follow_transformers_linear_layers(weight_only, bits):
    params = glm_6b_parameters()
    linear = {n: s for n, s in params.items() if n.endswith("_proj.weight")}  # q k v o gate_up down
    numel = sum(s[0] * s[1] for s in linear.values())
    out_channels = sum(s[0] for s in linear.values())  # q, k, v rows together are the fused qkv's rows
    expected = weight_bytes(SHAPES_6B, "float16") - 2 * numel + numel * bits // 8 + 2 * out_channels
    assert weight_bytes(SHAPES_6B, "float16", weight_only) == expected


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(SHAPES_6B, "float16") == 28_672  # chatglm3.md
    assert kv_bytes_per_token(SHAPES_6B, "float32") == 2 * 28_672
    assert kv_bytes_per_token(SHAPES_6B, "float16", tp=2) == 28_672 // 2  # one of the 2 KV heads per rank
    assert kv_bytes_per_token(SHAPES_6B, "float16", tp=4) == 28_672 // 2  # KV heads duplicated past 2 ranks


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_per_rank_weights_equal_a_converted_checkpoint(tmp_path, tp):
    from support.cli_calls import convert_checkpoint, synth_model

    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    synth_model("tiny", hf)
    convert_checkpoint(hf, ckpt, dtype="float16", tp_size=tp)
    shape = ChatGLMConfig.from_model_dir(hf)
    for rank in range(tp):
        with safe_open(str(ckpt / f"rank{rank}.safetensors"), framework="pt") as f:
            written = sum(f.get_tensor(name).numel() * 2 for name in f.keys())
        assert weight_bytes(shape, "float16", tp=tp) == written


@pytest.mark.parametrize("text, size", [
    ("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("24G", 24 * GiB), ("16000MiB", 16000 << 20),
    ("1.5TB", 15 * 10**11), ("141 GB", 141 * 10**9), ("40gib", 40 * GiB),
])
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["80", 80, "eighty", "80XB", "0GiB", "-4GiB", ""])
def test_parse_memory_rejects(text):
    with pytest.raises(UsageError, match="--gpu-memory"):
        parse_memory(text)


def test_plan_prints_a_table(capsys):
    result = plan(FP16_TP1)
    out = capsys.readouterr().out
    assert "KV bytes per token" in out and "28,672" in out and "fits" in out
    assert result.fits and result.kv_per_token == 28_672 and result.gpus == 1


def test_a_profile_that_cannot_fit_warns_and_strict_refuses(capsys, caplog):
    result = plan(FP16_TP1, gpu_memory="8GiB")
    assert not result.fits and "does not fit" in result.warnings[0]
    assert "warning" in caplog.text and "DOES NOT FIT" in capsys.readouterr().out
    with pytest.raises(UsageError, match="does not fit"):
        plan(FP16_TP1, gpu_memory="8GiB", strict=True)


def test_too_small_kv_cache_names_the_batch_that_fits():
    result = plan(FP16_TP1, gpu_memory="24GiB")  # 64 × 8192 tokens need 14 GiB of KV cache: too much
    assert not result.fits and "full-length sequences at once" in result.warnings[0]
    assert f"build.max_batch_size ≤ {result.max_batch_size} fits" in result.warnings[0]


def test_largest_max_batch_size_is_the_edge():
    profile = load_profile(FP16_TP1)
    largest = memory_plan(profile, SHAPES_6B, 24 * GiB).max_batch_size
    assert 10 < largest < 64
    fits = memory_plan(load_profile(FP16_TP1, {"build.max_batch_size": largest}), SHAPES_6B, 24 * GiB)
    too_many = memory_plan(load_profile(FP16_TP1, {"build.max_batch_size": largest + 1}), SHAPES_6B, 24 * GiB)
    assert fits.fits and not too_many.fits


def test_largest_max_num_tokens_is_the_edge():
    profile = load_profile(FP16_TP1, {"build.max_batch_size": 8})
    largest = memory_plan(profile, SHAPES_6B, 16 * GiB).max_num_tokens
    assert 4096 <= largest < 8 * 8192
    at = load_profile(FP16_TP1, {"build.max_batch_size": 8, "build.max_num_tokens": largest})
    over = load_profile(FP16_TP1, {"build.max_batch_size": 8, "build.max_num_tokens": largest + 64})
    assert memory_plan(at, SHAPES_6B, 16 * GiB).fits and not memory_plan(over, SHAPES_6B, 16 * GiB).fits


def test_gpus_plans_tensor_parallelism():
    one, two = plan(FP16_TP1), plan(FP16_TP1, gpus=2)
    assert two.gpus == 2 and two.kv_per_token == 28_672 // 2
    assert two.weights < one.weights and two.weights > one.weights / 2  # the embedding is not split
    with pytest.raises(UsageError, match="convert.tp_size must be one of"):
        plan(FP16_TP1, gpus=3)


def test_32k_batch_stays_within_tensorrt_llms_limit():
    assert plan(CONFIGS / "chatglm3-6b-32k-fp16-tp1.yaml", gpu_memory="141GB").max_batch_size == 78398 // 32768


def test_shapes_come_from_the_hf_config_when_readable(tmp_path, fixture_dir):
    tiny = plan(CONFIGS / "tiny.yaml", gpu_memory="1GiB")
    hf = json.loads((fixture_dir / "config.json").read_text())
    assert (tiny.shape.num_layers, tiny.shape.hidden_size) == (hf["num_layers"], hf["hidden_size"])
    with pytest.raises(ModelFileError, match="no published shapes"):
        plan(CONFIGS / "tiny.yaml", overrides={"model.dir": str(tmp_path / "nowhere")})


def test_cli_plan(tmp_path):
    ok = run_cli("plan", "--config", "configs/chatglm3-6b-int4-tp1.yaml", "--gpu-memory", "24GB")
    assert ok.returncode == 0 and "KV tokens that fit" in ok.stdout
    small = run_cli("plan", "--config", "configs/chatglm3-6b-fp16-tp1.yaml", "--gpu-memory", "8GiB")
    assert small.returncode == 0 and "warning" in small.stderr
    strict = run_cli("plan", "--config", "configs/chatglm3-6b-fp16-tp1.yaml", "--gpu-memory", "8GiB", "--strict")
    assert strict.returncode == 2 and strict.stderr.strip().splitlines()[-1].startswith("trtglm: error:")
