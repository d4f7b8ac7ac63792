"""ChatGLM config recognition from HF config.json files shaped like THUDM's published ones."""

import json

import pytest

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.errors import ModelFileError, UsageError

# Keys and values as in THUDM's published config.json files.
CHATGLM3_6B = {
    "_name_or_path": "THUDM/chatglm3-6b", "model_type": "chatglm", "architectures": ["ChatGLMModel"],
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "ffn_hidden_size": 13696, "hidden_size": 4096,
    "kv_channels": 128, "layernorm_epsilon": 1e-05, "multi_query_attention": True, "multi_query_group_num": 2,
    "num_attention_heads": 32, "num_layers": 28, "padded_vocab_size": 65024, "post_layer_norm": True,
    "rmsnorm": True, "seq_length": 8192, "torch_dtype": "float16",
}
VARIANTS = {  # name -> (changed keys, variant, rotary_base, position_scale)
    "THUDM/chatglm3-6b": ({}, "chatglm3-6b", 10000.0, 1.0),
    "THUDM/chatglm3-6b-base": ({"seq_length": 32768}, "chatglm3-6b-base", 10000.0, 1.0),
    "THUDM/chatglm3-6b-32k": ({"seq_length": 32768, "rope_ratio": 50}, "chatglm3-6b-32k", 500000.0, 1.0),
    "THUDM/chatglm3-6b-128k": ({"seq_length": 131072, "rope_ratio": 500}, "chatglm3-6b-128k", 5000000.0, 1.0),
    "THUDM/chatglm2-6b": ({"seq_length": 32768}, "chatglm2-6b", 10000.0, 1.0),
    "THUDM/chatglm2-6b-32k": ({"seq_length": 32768, "rope_ratio": 16}, "chatglm2-6b", 10000.0, 16.0),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_variants(name):
    changes, variant, base, scale = VARIANTS[name]
    cfg = ChatGLMConfig.from_hf_dict({**CHATGLM3_6B, **changes, "_name_or_path": name}, name=name)
    assert (cfg.variant, cfg.rotary_base, cfg.position_scale) == (variant, base, scale)
    assert cfg.version == ("chatglm2" if "chatglm2" in name else "chatglm3")


def test_6b_shapes():
    cfg = ChatGLMConfig.from_hf_dict(CHATGLM3_6B, name="THUDM/chatglm3-6b")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (28, 32, 2, 128)
    assert cfg.qkv_rows == 4608 and cfg.rotary_dim == 64 and cfg.vocab_size == 65024


def test_version_override_and_bad_version():
    cfg = ChatGLMConfig.from_hf_dict(CHATGLM3_6B, version="chatglm2")
    assert cfg.version == "chatglm2"
    with pytest.raises(UsageError, match="chatglm-version"):
        ChatGLMConfig.from_hf_dict(CHATGLM3_6B, version="chatglm4")


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not a ChatGLM2/ChatGLM3"),
    ({"architectures": ["GLMModel"]}, "not a ChatGLM2/ChatGLM3"),
    ({"padded_vocab_size": 151552, "_name_or_path": "THUDM/glm-4-9b-chat"}, "GLM-4"),
    ({"kv_channels": None}, "lacks required key"),
    ({"add_bias_linear": True}, "add_bias_linear"),
])
def test_unsupported_configs(changes, message):
    hf = {k: v for k, v in {**CHATGLM3_6B, **changes}.items() if v is not None}
    with pytest.raises(ModelFileError, match=message):
        ChatGLMConfig.from_hf_dict(hf, name=hf.get("_name_or_path", ""))


def test_config_file_errors(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        ChatGLMConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        ChatGLMConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CHATGLM3_6B))
    assert ChatGLMConfig.from_model_dir(tmp_path).variant == "chatglm3-6b"
