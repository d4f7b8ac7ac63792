"""`trtglm convert --fp8`: the checkpoint read back against NVIDIA's documented FP8 layout, its scales against
independent computations, and bad input.

The layout, as NVIDIA's sources give it:
- TensorRT-LLM tensorrt_llm/quantization/layers.py, `FP8Linear`: `weight` in FP8, `activation_scaling_factor` and
  `weights_scaling_factor` Parameters of shape (1,), float32; its attention layers' `kv_cache_scaling_factor`
  (1,) float32 (`kv_cache_quantize` in tensorrt_llm/quantization/quantize.py), named
  `transformer.layers.{l}.attention.kv_cache_scaling_factor`;
- TensorRT-LLM tensorrt_llm/models/modeling_utils.py, `preprocess_weights`: FP8 weights as float8_e4m3fn (or int8
  viewed as it), lm_head not quantized; config `quantization.quant_algo` "FP8", `kv_cache_quant_algo` "FP8";
- ModelOpt modelopt/torch/quantization/nn/modules/tensor_quantizer.py `export_amax` (a per-tensor amax exported with
  shape [1]) and modelopt/torch/export/quant_utils.py `get_scaling_factor` (scale = amax / 448, e4m3's largest) and
  `get_kv_cache_scaling_factor` (an FP8 KV cache's scale is at least 1.0);
- safetensors' dtype code for float8_e4m3fn: "F8_E4M3".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.cli_calls import convert_checkpoint
from trtglm.chatglm import chat
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.chatglm.weights import HFWeights
from trtglm.cli import main
from trtglm.convert.fp8 import DEFAULT_PROMPTS

E4M3_MAX = 448.0
LINEARS = {  # TensorRT-LLM linear -> (HF weight, transformers' GlmForCausalLM module whose input it takes)
    "attention.qkv": ("self_attention.query_key_value.weight", "self_attn.q_proj"),
    "attention.dense": ("self_attention.dense.weight", "self_attn.o_proj"),
    "mlp.fc": ("mlp.dense_h_to_4h.weight", "mlp.gate_up_proj"),
    "mlp.proj": ("mlp.dense_4h_to_h.weight", "mlp.down_proj"),
}


@pytest.fixture(scope="module")
def fp8_tp2(tmp_path_factory, fixture_dir) -> Path:
    return convert_checkpoint(fixture_dir, tmp_path_factory.mktemp("fp8") / "tp2", dtype="bfloat16", tp_size=2,
                              fp8=True, fp8_kv_cache=True)


@pytest.fixture(scope="module")
def bf16_tp2(tmp_path_factory, fixture_dir) -> Path:
    return convert_checkpoint(fixture_dir, tmp_path_factory.mktemp("bf16") / "tp2", dtype="bfloat16", tp_size=2)


def header(file: Path) -> dict:
    """The raw safetensors header: {name: {"dtype", "shape", "data_offsets"}}."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(length))
    entries.pop("__metadata__", None)
    return entries


def test_fp8_checkpoint_has_nvidias_layout(fp8_tp2, bf16_tp2):
    config = json.loads((fp8_tp2 / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert config["dtype"] == "bfloat16"
    for rank in (0, 1):
        fp8, plain = header(fp8_tp2 / f"rank{rank}.safetensors"), header(bf16_tp2 / f"rank{rank}.safetensors")
        for layer in range(3):
            p = f"transformer.layers.{layer}."
            for linear in LINEARS:
                weight = fp8[f"{p}{linear}.weight"]
                assert (weight["dtype"], weight["shape"]) == ("F8_E4M3", plain[f"{p}{linear}.weight"]["shape"])
                for kind in ("weights_scaling_factor", "activation_scaling_factor"):
                    assert (fp8[f"{p}{linear}.{kind}"]["dtype"], fp8[f"{p}{linear}.{kind}"]["shape"]) == ("F32", [1])
            assert (fp8[f"{p}attention.kv_cache_scaling_factor"]["dtype"],
                    fp8[f"{p}attention.kv_cache_scaling_factor"]["shape"]) == ("F32", [1])
        scales = {name for name in fp8 if name.endswith("scaling_factor")}
        assert len(scales) == 3 * (4 * 2 + 1)
        # everything else exactly as an unquantized conversion writes it: lm_head, embedding, norms, qkv bias
        unquantized = {name: entry for name, entry in fp8.items() if name not in scales and entry["dtype"] != "F8_E4M3"}
        assert set(unquantized) == {name for name in plain if not name.endswith(tuple(f"{n}.weight" for n in LINEARS))}
        assert {name: (e["dtype"], e["shape"]) for name, e in unquantized.items()} == \
            {name: (plain[name]["dtype"], plain[name]["shape"]) for name in unquantized}
        assert unquantized["lm_head.weight"]["dtype"] == "BF16"


def test_weights_are_fp8_at_the_whole_tensors_scale(fp8_tp2, bf16_tp2, fixture_dir):
    weights = HFWeights(fixture_dir)
    fp8 = [load_file(str(fp8_tp2 / f"rank{r}.safetensors")) for r in (0, 1)]
    plain = [load_file(str(bf16_tp2 / f"rank{r}.safetensors")) for r in (0, 1)]
    for layer in range(3):
        for linear, (hf, _) in LINEARS.items():
            name = f"transformer.layers.{layer}.{linear}"
            amax = float(weights.get(f"transformer.encoder.layers.{layer}.{hf}").to(torch.bfloat16).float().abs().max())
            scales = [float(rank[f"{name}.weights_scaling_factor"]) for rank in fp8]
            assert scales[0] == scales[1] == pytest.approx(amax / E4M3_MAX, rel=1e-6)
            values = [rank[f"{name}.weight"].float() for rank in fp8]
            assert max(float(v.abs().max()) for v in values) == E4M3_MAX  # the largest weight lands on e4m3's largest
            for value, reference in zip(values, (rank[f"{name}.weight"].float() for rank in plain)):
                # e4m3 keeps 3 mantissa bits: within half a unit (2^-4 relative), or 2^-10 of the scale when subnormal
                bound = torch.maximum(reference.abs() * 2**-4, torch.full_like(reference, scales[0] * 2**-10))
                assert ((value * scales[0] - reference).abs() <= bound * 1.0001).all(), name


def calibration_chats(path: Path) -> list[list[dict]]:
    return [[{"role": "user", "content": line}] for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def transformers_input_amax(fixture_dir: Path, chats: list[list[dict]]) -> dict[str, float]:
    """Each linear's largest input magnitude, by forward hooks on transformers' GlmForCausalLM (float32, weights as
    rounded to bfloat16) over `chats`: an independent calibration."""
    weights = HFWeights(fixture_dir)
    model = load_reference(ChatGLMConfig.from_model_dir(fixture_dir),
                           lambda name: weights.get(name).to(torch.bfloat16).float(), torch.float32)
    seen: dict[str, float] = {}

    def hook(name: str):
        def record(module, inputs):
            seen[name] = max(seen.get(name, 0.0), float(inputs[0].abs().max()))
        return record

    for layer in range(3):
        for linear, (_, module) in LINEARS.items():
            model.get_submodule(f"model.layers.{layer}.{module}").register_forward_pre_hook(
                hook(f"transformer.layers.{layer}.{linear}"))
    tokenizer = ChatGLMTokenizer(fixture_dir)
    with torch.no_grad():
        for messages in chats:
            model(torch.tensor([chat.chat_ids(tokenizer, messages)]))
    return seen


def test_activation_scales_are_the_inputs_largest_magnitude_over_the_prompts(fp8_tp2, fixture_dir):
    expected = transformers_input_amax(fixture_dir, calibration_chats(DEFAULT_PROMPTS))
    tensors = [load_file(str(fp8_tp2 / f"rank{r}.safetensors")) for r in (0, 1)]
    for name, amax in expected.items():
        found = [float(rank[f"{name}.activation_scaling_factor"]) for rank in tensors]
        assert found[0] == found[1] == pytest.approx(amax / E4M3_MAX, rel=1e-4), name
    for layer in range(3):  # the fixture's keys and values stay far below 448: ModelOpt's floor of 1.0
        assert float(tensors[0][f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]) == 1.0


def test_calibration_reads_the_users_prompts(tmp_path, fixture_dir):
    chats = [[{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."},
              {"role": "user", "content": "And four plus four?"}]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": chats[0] + [{"role": "assistant", "content": "Eight."}]}) + "\n")
    out = convert_checkpoint(fixture_dir, tmp_path / "ckpt", dtype="bfloat16", fp8=True,
                             calibration_prompts=str(prompts))
    tensors = load_file(str(out / "rank0.safetensors"))
    assert "transformer.layers.0.attention.kv_cache_scaling_factor" not in tensors
    assert json.loads((out / "config.json").read_text())["quantization"] == {"quant_algo": "FP8",
                                                                             "kv_cache_quant_algo": None}
    for name, amax in transformers_input_amax(fixture_dir, chats).items():  # the answer itself is not prompted
        assert float(tensors[f"{name}.activation_scaling_factor"]) == pytest.approx(amax / E4M3_MAX, rel=1e-4)


def run_in_process(capsys, *args: str) -> tuple[int, str]:
    """(exit code, last stderr line) of `trtglm ARGS` through the CLI entry point in this process."""
    try:
        main([*map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.parametrize("flags, prompts, message", [
    (["--fp8"], "", "no prompts"),
    (["--fp8"], "\n  \n", "no prompts"),
    (["--fp8"], None, "cannot read"),
    (["--fp8", "--weight-only", "int8"], "hi\n", "--fp8 and --weight-only int8 exclude one another"),
    (["--fp8", "--dtype", "float32"], "hi\n", "--fp8 needs --dtype float16 or bfloat16"),
    (["--fp8-kv-cache"], "hi\n", "--fp8-kv-cache and --calibration-prompts need --fp8"),
    ([], "hi\n", "--fp8-kv-cache and --calibration-prompts need --fp8"),
])
def test_bad_fp8_conversions_are_one_line_and_leave_nothing(capsys, tmp_path, fixture_dir, flags, prompts, message):
    file = tmp_path / "prompts.txt"
    if prompts is not None:
        file.write_text(prompts)
    out = tmp_path / "ckpt"
    dtype = [] if "--dtype" in flags else ["--dtype", "bfloat16"]
    code, last = run_in_process(capsys, "convert", "--model-dir", fixture_dir, "--output-dir", out,
                                "--calibration-prompts", file, *dtype, *flags)
    assert code == 2 and last.startswith("trtglm: error:") and message in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == (["prompts.txt"] if prompts is not None else [])
