"""ChatGLM2/ChatGLM3 model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from trtglm.chatglm.variants import DEFAULT_VERSION, VERSIONS, published_variant
from trtglm.errors import ModelFileError, UsageError
from trtglm.files import read_json_object

log = logging.getLogger(__name__)

TP_SIZES = (1, 2, 4, 8)  # the tensor-parallel sizes a checkpoint is split into (convert, profiles)
ARCHITECTURES = ("ChatGLMModel", "ChatGLMForConditionalGeneration", "ChatGLMForCausalLM")


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads are split when there are enough, otherwise each rank holds one (repeated) head."""
    return max(1, kv_heads // tp)


def kv_bytes_per_position(layers: int, kv_heads: int, head_dim: int, tp: int, itemsize: int) -> int:
    """One position's keys and values, every layer, on one of `tp` ranks."""
    return 2 * layers * kv_heads_per_rank(kv_heads, tp) * head_dim * itemsize

# HF config key -> (field, required).  Optional keys fall back to ChatGLM3-6B's values.
_REQUIRED_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "kv_channels",
    "multi_query_group_num",
    "ffn_hidden_size",
    "padded_vocab_size",
    "seq_length",
)


@dataclass(frozen=True)
class ChatGLMConfig:
    version: str  # "chatglm3" | "chatglm2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # padded: rows of the embedding and the output layer
    seq_length: int
    layernorm_epsilon: float = 1e-5
    rope_ratio: float = 1.0
    add_qkv_bias: bool = True
    torch_dtype: str = "float16"
    architecture: str = "ChatGLMModel"

    @property
    def rotary_dim(self) -> int:
        """Rotary embedding covers the first half of each head."""
        return self.head_dim // 2

    @property
    def rotary_base(self) -> float:
        """ChatGLM3 scales the base by rope_ratio; ChatGLM2 keeps 10000 (linear scaling instead)."""
        return 10000.0 * self.rope_ratio if self.version == "chatglm3" else 10000.0

    @property
    def position_scale(self) -> float:
        """ChatGLM2 divides positions by rope_ratio (linear scaling); ChatGLM3 does not."""
        return self.rope_ratio if self.version == "chatglm2" else 1.0

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def variant(self) -> str:
        """The published model this config matches (for messages), or `<version>-custom`."""
        return published_variant(self.version, self.num_layers, self.hidden_size, self.seq_length, self.rope_ratio)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, hf: dict, version: str = "auto", name: str = "") -> "ChatGLMConfig":
        """Build from the keys of an HF ChatGLM `config.json`; `name` helps guess the version."""
        arch = (hf.get("architectures") or [None])[0]
        if hf.get("model_type") != "chatglm" or arch not in ARCHITECTURES:
            raise ModelFileError(
                f"not a ChatGLM2/ChatGLM3 checkpoint: model_type={hf.get('model_type')!r}, "
                f"architectures={hf.get('architectures')!r} (expected model_type 'chatglm' and one of "
                f"{', '.join(ARCHITECTURES)})"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in hf]
        if missing:
            raise ModelFileError(f"config.json lacks required key(s): {', '.join(missing)}")
        if version == "auto":
            version = guess_version(hf, name)
        elif version not in VERSIONS:
            raise UsageError(f"--chatglm-version must be auto, {' or '.join(VERSIONS)}, not {version!r}")
        if not hf.get("rmsnorm", True) or hf.get("apply_residual_connection_post_layernorm", False):
            raise ModelFileError("unsupported ChatGLM variant: expects rmsnorm=true and pre-layernorm residuals")
        if hf.get("add_bias_linear", False):
            raise ModelFileError("unsupported ChatGLM variant: add_bias_linear=true")
        return cls(
            version=version,
            num_layers=_number(hf, "num_layers", int),
            hidden_size=_number(hf, "hidden_size", int),
            num_heads=_number(hf, "num_attention_heads", int),
            num_kv_heads=_number(hf, "multi_query_group_num" if hf.get("multi_query_attention", True)
                                 else "num_attention_heads", int),
            head_dim=_number(hf, "kv_channels", int),
            ffn_hidden_size=_number(hf, "ffn_hidden_size", int),
            vocab_size=_number(hf, "padded_vocab_size", int),
            seq_length=_number(hf, "seq_length", int),
            layernorm_epsilon=_number({"layernorm_epsilon": 1e-5, **hf}, "layernorm_epsilon", float),
            rope_ratio=_number({**hf, "rope_ratio": hf.get("rope_ratio") or 1.0}, "rope_ratio", float),
            add_qkv_bias=bool(hf.get("add_qkv_bias", True)),
            torch_dtype=str(hf.get("torch_dtype", "float16")),
            architecture=arch,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, version: str = "auto") -> "ChatGLMConfig":
        model_dir = Path(model_dir)
        hf = read_json_object(model_dir / "config.json")
        return cls.from_hf_dict(hf, version, name=f"{model_dir.name} {hf.get('_name_or_path', '')}")


def _number(hf: dict, key: str, kind: type):
    """hf[key] as an int (a whole number > 0) or a float (> 0); ModelFileError naming the key otherwise."""
    value = hf[key]
    ok = (isinstance(value, int) if kind is int else isinstance(value, (int, float))) and not isinstance(value, bool)
    if not ok or value <= 0:
        what = "a whole number" if kind is int else "a number"
        raise ModelFileError(f"config.json: {key} must be {what} above 0, not {value!r}")
    return kind(value)


def guess_version(hf: dict, name: str) -> str:
    """ChatGLM2 and ChatGLM3 share config keys; the published names tell them apart."""
    name = name.lower()
    if "glm-4" in name or "glm4" in name or hf.get("padded_vocab_size", 0) > 65024:
        raise ModelFileError("GLM-4 checkpoints are not supported (ChatGLM2/ChatGLM3 only)")
    if "chatglm2" in name:
        return "chatglm2"
    if "chatglm3" not in name:
        log.warning("could not tell ChatGLM2 from ChatGLM3 by name (%s); assuming %s "
                    "(use --chatglm-version to say otherwise)", name.strip() or "no name", DEFAULT_VERSION)
    return DEFAULT_VERSION


# THUDM/chatglm3-6b's published config.json (every key): the 6B shapes where no config.json is at hand
# (`trtglm plan`), and the base of `synth-model`'s presets.
CHATGLM3_6B_CONFIG: dict = {
    "_name_or_path": "THUDM/chatglm3-6b",
    "model_type": "chatglm",
    "architectures": ["ChatGLMModel"],
    "auto_map": {
        "AutoConfig": "configuration_chatglm.ChatGLMConfig",
        "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
    },
    "add_bias_linear": False,
    "add_qkv_bias": True,
    "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False,
    "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True,
    "ffn_hidden_size": 13696,
    "fp32_residual_connection": False,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "kv_channels": 128,
    "layernorm_epsilon": 1e-05,
    "multi_query_attention": True,
    "multi_query_group_num": 2,
    "num_attention_heads": 32,
    "num_layers": 28,
    "original_rope": True,
    "padded_vocab_size": 65024,
    "post_layer_norm": True,
    "rmsnorm": True,
    "seq_length": 8192,
    "use_cache": True,
    "torch_dtype": "float16",
    "transformers_version": "4.30.2",
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
