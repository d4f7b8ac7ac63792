"""The name table and tensor-parallel split rules against independently derived expectations.

Source tensors are built so that every row says what it is (Q/K/V, head, dim or gate/up,
index); the expected content of each rank is derived from what attention and SwiGLU need,
not from the rules' own arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.convert.names import DROPPED, mapped_tensors
from trtglm.convert.split import RULES, split_cols, split_qkv, split_rows, split_swap_gate_up, whole
from trtglm.convert.writer import plan_conversion
from trtglm.errors import UsageError


def chatglm(layers=28, hidden=4096, heads=32, kv=2, head_dim=128, ffn=13696, vocab=65024, bias=True):
    return ChatGLMConfig(version="chatglm3", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                         head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=vocab, seq_length=8192,
                         add_qkv_bias=bias)


SIX_B = chatglm()
Q, K, V = 0, 1, 2


def labelled_qkv(heads: int, kv: int, head_dim: int, cols: int = 0) -> torch.Tensor:
    """HF qkv rows [Q heads; K heads; V heads], each row valued kind*10^6 + head*10^3 + dim."""
    labels = [kind * 10**6 + head * 10**3 + dim
              for kind, n in ((Q, heads), (K, kv), (V, kv)) for head in range(n) for dim in range(head_dim)]
    rows = torch.tensor(labels, dtype=torch.float64)
    return rows if cols == 0 else rows[:, None].repeat(1, cols)


def decode(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """(kind, head, dim) of each row of a labelled tensor."""
    values = rows if rows.dim() == 1 else rows[:, 0]
    return [(int(v) // 10**6, int(v) // 10**3 % 1000, int(v) % 1000) for v in values]


def expected_qkv_rows(heads: int, kv: int, head_dim: int, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """What rank `rank` needs: its query heads, then the KV heads those query heads attend with."""
    q_heads = range(rank * heads // tp, (rank + 1) * heads // tp)
    kv_heads = sorted({h // (heads // kv) for h in q_heads})  # grouped-query attention: heads/kv per group
    return ([(Q, h, d) for h in q_heads for d in range(head_dim)]
            + [(K, h, d) for h in kv_heads for d in range(head_dim)]
            + [(V, h, d) for h in kv_heads for d in range(head_dim)])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("heads,kv", [(32, 2), (8, 2), (8, 8), (16, 4)])
def test_qkv_weight_and_bias_hold_each_ranks_heads(tp, heads, kv):
    head_dim = 4
    cfg = chatglm(heads=heads, kv=kv, head_dim=head_dim, hidden=heads * head_dim)
    for source in (labelled_qkv(heads, kv, head_dim, cols=3), labelled_qkv(heads, kv, head_dim)):
        selections = split_qkv(tuple(source.shape), cfg, tp)
        assert len(selections) == tp
        for rank, selection in enumerate(selections):
            part = selection.apply(source)
            assert decode(part) == expected_qkv_rows(heads, kv, head_dim, tp, rank)
            assert selection.shape(tuple(source.shape)) == tuple(part.shape)


def test_qkv_duplicates_kv_heads_head_contiguously():
    """tp=4, 2 KV heads: ranks 0,1 get KV head 0; ranks 2,3 get KV head 1."""
    source = labelled_qkv(32, 2, 2)
    kv_heads_of_rank = [{head for kind, head, _ in decode(s.apply(source)) if kind != Q}
                        for s in split_qkv(tuple(source.shape), chatglm(heads=32, kv=2, head_dim=2), 4)]
    assert kv_heads_of_rank == [{0}, {0}, {1}, {1}]


@pytest.mark.parametrize("tp,rows", [(1, 4608), (2, 2304), (4, 1280), (8, 768)])
def test_qkv_rows_per_rank_for_chatglm3_6b(tp, rows):
    planned = {p.trt: p for p in plan_conversion(SIX_B, tp)}
    qkv = planned["transformer.layers.0.attention.qkv.weight"]
    assert [qkv.rank_shape(r) for r in range(tp)] == [(rows, 4096)] * tp
    assert [planned["transformer.layers.27.attention.qkv.bias"].rank_shape(r) for r in range(tp)] == [(rows,)] * tp


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fc_is_up_then_gate_per_rank(tp):
    ffn = 16
    gate = torch.arange(ffn, dtype=torch.float64) + 1000  # HF rows: [gate; up]
    up = torch.arange(ffn, dtype=torch.float64) + 2000
    source = torch.cat([gate, up])[:, None].repeat(1, 3)
    for rank, selection in enumerate(split_swap_gate_up(tuple(source.shape), chatglm(ffn=ffn), tp)):
        mine = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
        assert torch.equal(selection.apply(source)[:, 0], torch.cat([up[mine], gate[mine]]))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_row_and_column_chunks(tp):
    source = torch.arange(16 * 24, dtype=torch.float64).reshape(16, 24)
    for rank, selection in enumerate(split_rows(tuple(source.shape), SIX_B, tp)):
        assert torch.equal(selection.apply(source), source[rank * 16 // tp:(rank + 1) * 16 // tp])
    for rank, selection in enumerate(split_cols(tuple(source.shape), SIX_B, tp)):
        assert torch.equal(selection.apply(source), source[:, rank * 24 // tp:(rank + 1) * 24 // tp])
    for selection in whole(tuple(source.shape), SIX_B, tp):
        assert torch.equal(selection.apply(source), source)


@pytest.mark.parametrize("tp,cfg,message", [
    (8, chatglm(heads=4, kv=2, hidden=512), "attention heads"),
    (2, chatglm(heads=6, kv=3, hidden=768), "KV heads"),
])
def test_qkv_refuses_indivisible_heads(tp, cfg, message):
    with pytest.raises(UsageError, match=message):
        split_qkv((cfg.qkv_rows, cfg.hidden_size), cfg, tp)


def test_other_rules_refuse_indivisible_sizes():
    with pytest.raises(UsageError, match="ffn_hidden_size"):
        split_swap_gate_up((2 * 6, 8), SIX_B, 4)
    with pytest.raises(UsageError, match="vocabulary"):
        split_rows((65022, 8), SIX_B, 4)
    with pytest.raises(UsageError, match="row-parallel"):
        split_cols((8, 6), SIX_B, 4)


# The table, written out from the TensorRT-LLM checkpoint layout for layer 0.
LAYER0 = {"transformer.encoder.layers.0." + hf: ("transformer.layers.0." + trt, rule) for hf, (trt, rule) in {
    "input_layernorm.weight": ("input_layernorm.weight", "whole"),
    "self_attention.query_key_value.weight": ("attention.qkv.weight", "qkv"),
    "self_attention.query_key_value.bias": ("attention.qkv.bias", "qkv"),
    "self_attention.dense.weight": ("attention.dense.weight", "cols"),
    "post_attention_layernorm.weight": ("post_layernorm.weight", "whole"),
    "mlp.dense_h_to_4h.weight": ("mlp.fc.weight", "swap_gate_up"),
    "mlp.dense_4h_to_h.weight": ("mlp.proj.weight", "cols"),
}.items()}
GLOBAL = {
    "transformer.embedding.word_embeddings.weight": ("transformer.vocab_embedding.weight", "whole"),
    "transformer.encoder.final_layernorm.weight": ("transformer.ln_f.weight", "whole"),
    "transformer.output_layer.weight": ("lm_head.weight", "rows"),
}


def test_table_names_and_rules():
    mapped = {m.hf: (m.trt, m.rule) for m in mapped_tensors(chatglm(layers=1))}
    assert mapped == {**GLOBAL, **LAYER0}
    assert DROPPED == ("transformer.rotary_pos_emb.inv_freq",)
    assert set(RULES) == {"whole", "rows", "cols", "qkv", "swap_gate_up"}


@pytest.mark.parametrize("layers", [1, 3, 28])
def test_tensor_count_is_3_plus_7_per_layer(layers):
    """7 per layer counts the qkv bias; without it (add_qkv_bias false) there are 6."""
    with_bias = mapped_tensors(chatglm(layers=layers))
    assert len(with_bias) == 3 + 7 * layers
    assert len(mapped_tensors(chatglm(layers=layers, bias=False))) == 3 + 6 * layers
    assert len({m.trt for m in with_bias}) == len(with_bias)
    assert with_bias[0].trt == "transformer.vocab_embedding.weight" and with_bias[-1].trt == "lm_head.weight"


def test_six_b_shapes():
    shapes = {m.hf: m.shape for m in mapped_tensors(SIX_B)}
    assert shapes["transformer.embedding.word_embeddings.weight"] == (65024, 4096)
    assert shapes["transformer.encoder.layers.27.self_attention.query_key_value.weight"] == (4608, 4096)
    assert shapes["transformer.encoder.layers.27.self_attention.query_key_value.bias"] == (4608,)
    assert shapes["transformer.encoder.layers.27.self_attention.dense.weight"] == (4096, 4096)
    assert shapes["transformer.encoder.layers.27.mlp.dense_h_to_4h.weight"] == (27392, 4096)
    assert shapes["transformer.encoder.layers.27.mlp.dense_4h_to_h.weight"] == (4096, 13696)
    assert shapes["transformer.output_layer.weight"] == (65024, 4096)
