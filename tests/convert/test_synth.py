"""`trtglm synth-model`: the published ChatGLM3 HF layout, shapes, determinism, usability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import run_cli
from support.cli_calls import synth_model
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.weights import HFWeights
from trtglm.convert.synth import assign_shards, preset_config, shard_file_names, tensor_specs
from trtglm.errors import OutputExistsError, UsageError

# THUDM/chatglm3-6b config.json, as published.
THUDM_KEYS = {
    "_name_or_path", "model_type", "architectures", "auto_map", "add_bias_linear", "add_qkv_bias",
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm", "attention_dropout",
    "attention_softmax_in_fp32", "bias_dropout_fusion", "ffn_hidden_size", "fp32_residual_connection",
    "hidden_dropout", "hidden_size", "kv_channels", "layernorm_epsilon", "multi_query_attention",
    "multi_query_group_num", "num_attention_heads", "num_layers", "original_rope", "padded_vocab_size",
    "post_layer_norm", "rmsnorm", "seq_length", "use_cache", "torch_dtype", "transformers_version",
    "tie_word_embeddings", "eos_token_id", "pad_token_id",
}


def tiny_shapes(layers: int = 3) -> dict[str, tuple[int, ...]]:
    """Tiny preset: hidden 128, 8 heads of 16, 2 KV groups, ffn 256, vocab 512."""
    shapes = {
        "transformer.embedding.word_embeddings.weight": (512, 128),
        "transformer.rotary_pos_emb.inv_freq": (4,),  # half of the 8 rotary dims of a 16-dim head
        "transformer.encoder.final_layernorm.weight": (128,),
        "transformer.output_layer.weight": (512, 128),
    }
    for n in range(layers):
        p = f"transformer.encoder.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (128,),
            p + "self_attention.query_key_value.weight": (8 * 16 + 2 * 2 * 16, 128),
            p + "self_attention.query_key_value.bias": (192,),
            p + "self_attention.dense.weight": (128, 128),
            p + "post_attention_layernorm.weight": (128,),
            p + "mlp.dense_h_to_4h.weight": (2 * 256, 128),
            p + "mlp.dense_4h_to_h.weight": (128, 256),
        }
    return shapes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "tiny-chatglm3"
    run_cli("synth-model", "--preset", "tiny", "--out", out, check=True)
    return out


def test_tiny_layout_shapes_and_index(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert set(config) == THUDM_KEYS
    assert {k: config[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "kv_channels",
                                   "multi_query_group_num", "ffn_hidden_size", "padded_vocab_size", "seq_length",
                                   "torch_dtype", "architectures", "model_type")} == {
        "num_layers": 3, "hidden_size": 128, "num_attention_heads": 8, "kv_channels": 16, "multi_query_group_num": 2,
        "ffn_hidden_size": 256, "padded_vocab_size": 512, "seq_length": 512, "torch_dtype": "float16",
        "architectures": ["ChatGLMModel"], "model_type": "chatglm"}
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in tiny.iterdir()) == sorted(["config.json", "model.safetensors.index.json", *shards])
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    found = {}
    for shard in shards:
        with safe_open(tiny / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            found |= {name: (tuple(f.get_slice(name).get_shape()), shard) for name in f.keys()}
    assert {name: shape for name, (shape, _) in found.items()} == tiny_shapes()
    assert index["weight_map"] == {name: shard for name, (_, shard) in found.items()}
    assert index["metadata"]["total_size"] == sum(2 * torch.Size(s).numel() for s in tiny_shapes().values())


def test_values_are_small_and_inv_freq_is_real(tiny):
    weights = HFWeights(tiny)
    inv_freq = weights.get("transformer.rotary_pos_emb.inv_freq").float()
    expected = torch.tensor([1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75])  # 1 / 10000^(2i/8)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-3, atol=0)
    qkv = weights.get("transformer.encoder.layers.1.self_attention.query_key_value.weight").float()
    assert 0.015 < qkv.std() < 0.025 and qkv.mean().abs() < 0.005
    norm = weights.get("transformer.encoder.layers.1.input_layernorm.weight").float()
    assert (norm - 1).abs().max() < 0.5 and norm.std() > 0.01


def test_reference_forward_is_finite(tiny):
    model = load_reference(ChatGLMConfig.from_model_dir(tiny), HFWeights(tiny).get)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 100]])).logits
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_same_seed_same_bytes_other_seed_other_bytes(tiny, tmp_path):
    again = synth_model("tiny", tmp_path / "again")
    other = synth_model("tiny", tmp_path / "other", seed=1)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (again / shard).read_bytes() == (tiny / shard).read_bytes()
        assert (other / shard).read_bytes() != (tiny / shard).read_bytes()


def test_bin_format_holds_the_same_tensors(tiny, tmp_path):
    out = synth_model("tiny", tmp_path / "bin", fmt="bin", layers=2)
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "pytorch_model.bin.index.json",
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"])
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded |= torch.load(out / shard, weights_only=True)
    assert {n: tuple(t.shape) for n, t in loaded.items()} == tiny_shapes(layers=2)
    reference = HFWeights(tiny)
    for name, tensor in loaded.items():  # fewer layers: the same first layers
        assert torch.equal(tensor, reference.get(name)), name


@pytest.mark.parametrize("preset,seq,rope_ratio", [("6b", 8192, None), ("6b-32k", 32768, 50)])
def test_six_b_presets_plan(preset, seq, rope_ratio):
    """6B shapes and sharding, planned without writing 12 GB."""
    config = preset_config(preset)
    assert set(config) - {"rope_ratio"} == THUDM_KEYS
    assert (config["seq_length"], config.get("rope_ratio")) == (seq, rope_ratio)
    cfg = ChatGLMConfig.from_hf_dict(config, "chatglm3")
    specs = dict(tensor_specs(cfg))
    assert len(specs) == 3 + 7 * 28 + 1
    assert specs["transformer.encoder.layers.27.self_attention.query_key_value.weight"] == (4608, 4096)
    assert specs["transformer.encoder.layers.0.mlp.dense_h_to_4h.weight"] == (27392, 4096)
    assert specs["transformer.rotary_pos_emb.inv_freq"] == (32,)
    assert sum(torch.Size(s).numel() for s in specs.values()) == 6_243_584_032
    shard_of = assign_shards(list(specs.items()), torch.float16, 7)
    assert sorted(set(shard_of.values())) == list(range(7))
    assert shard_file_names("safetensors", 7)[0] == "model-00001-of-00007.safetensors"
    assert shard_file_names("bin", 7)[6] == "pytorch_model-00007-of-00007.bin"
    order = [shard_of[name] for name in specs]
    assert order == sorted(order)  # consecutive tensors share a shard, as published


def test_refusals(tiny, tmp_path):
    with pytest.raises(OutputExistsError):
        synth_model("tiny", tiny)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(OutputExistsError):
        synth_model("tiny", tmp_path / "notes", force=True)
    for kwargs in ({"preset": "7b"}, {"layers": 0}, {"fmt": "gguf"}, {"dtype": "int8"}):
        with pytest.raises(UsageError):
            synth_model(**{"preset": "tiny", "out": tmp_path / "x", **kwargs})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
