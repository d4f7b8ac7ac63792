"""transformers' `GlmForCausalLM` as the reference implementation of ChatGLM3.

`GlmForCausalLM` computes the same function as ChatGLM3's remote code once the weights are
renamed and the fused QKV is split by rows (shared facts: chatglm3.md). It needs no
`trust_remote_code`, so it is the trusted reference that conversion and the runtime are
checked against. ChatGLM2's linear rope scaling has no Glm equivalent, so only ChatGLM3
(and ChatGLM2 with rope_ratio 1) can be compared this way.
"""

from __future__ import annotations

import torch

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.errors import UsageError

HF_PREFIX = "transformer.encoder.layers.{layer}."

# ChatGLM HF name -> GlmForCausalLM name; qkv is handled separately (split by rows).
_RENAMES = {
    "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "transformer.encoder.final_layernorm.weight": "model.norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
    HF_PREFIX + "input_layernorm.weight": "model.layers.{layer}.input_layernorm.weight",
    HF_PREFIX + "self_attention.dense.weight": "model.layers.{layer}.self_attn.o_proj.weight",
    HF_PREFIX + "post_attention_layernorm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    HF_PREFIX + "mlp.dense_h_to_4h.weight": "model.layers.{layer}.mlp.gate_up_proj.weight",
    HF_PREFIX + "mlp.dense_4h_to_h.weight": "model.layers.{layer}.mlp.down_proj.weight",
}
_QKV = HF_PREFIX + "self_attention.query_key_value.{kind}"
_QKV_TARGETS = ("model.layers.{layer}.self_attn.q_proj.{kind}",
                "model.layers.{layer}.self_attn.k_proj.{kind}",
                "model.layers.{layer}.self_attn.v_proj.{kind}")


def glm_config(cfg: ChatGLMConfig):
    """The transformers `GlmConfig` that computes the same function as `cfg`."""
    from transformers import GlmConfig

    if cfg.position_scale != 1.0:
        raise UsageError("ChatGLM2 with rope_ratio > 1 (linear rope scaling) has no GlmForCausalLM equivalent")
    return GlmConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base, "partial_rotary_factor": 0.5},
        attention_bias=cfg.add_qkv_bias,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=[2],
        bos_token_id=None,
    )


def chatglm_to_glm(cfg: ChatGLMConfig, get) -> dict[str, torch.Tensor]:
    """GlmForCausalLM state dict from a ChatGLM one; `get(name)` returns a ChatGLM tensor."""
    out: dict[str, torch.Tensor] = {}
    rows = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    for layer in range(cfg.num_layers):
        for src, dst in _RENAMES.items():
            if "{layer}" in src or layer == 0:
                out[dst.format(layer=layer)] = get(src.format(layer=layer))
        kinds = ("weight", "bias") if cfg.add_qkv_bias else ("weight",)
        for kind in kinds:
            parts = get(_QKV.format(layer=layer, kind=kind)).split(rows, dim=0)
            for target, part in zip(_QKV_TARGETS, parts):
                out[target.format(layer=layer, kind=kind)] = part
    return out


def glm_to_chatglm(cfg: ChatGLMConfig, glm_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `chatglm_to_glm`: ChatGLM HF names from a GlmForCausalLM state dict."""
    out: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for src, dst in _RENAMES.items():
            if "{layer}" in src or layer == 0:
                out[src.format(layer=layer)] = glm_state[dst.format(layer=layer)]
        kinds = ("weight", "bias") if cfg.add_qkv_bias else ("weight",)
        for kind in kinds:
            parts = [glm_state[t.format(layer=layer, kind=kind)] for t in _QKV_TARGETS]
            out[_QKV.format(layer=layer, kind=kind)] = torch.cat(parts, dim=0)
    return out


def load_reference(cfg: ChatGLMConfig, get, dtype: torch.dtype = torch.float32):
    """A `GlmForCausalLM` in eval mode holding the ChatGLM weights given by `get(name)`."""
    from transformers import GlmForCausalLM

    with torch.device("meta"):
        model = GlmForCausalLM(glm_config(cfg))
    state = {k: v.to(dtype) for k, v in chatglm_to_glm(cfg, get).items()}
    model.load_state_dict(state, assign=True, strict=True)
    model.model.rotary_emb.__init__(model.config)  # rebuild inv_freq buffers off the meta device
    return model.to(dtype).eval()
