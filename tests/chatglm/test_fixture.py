"""The trained tiny ChatGLM3 fixture: real ChatGLM3 layout, and exact greedy answers.

Layout expectations are ChatGLM3-6B's published config keys and tensor names at the tiny
shapes. The answers are checked with transformers' GlmForCausalLM and its own `generate`
(greedy), loaded from the fixture's files.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.chat import chat_ids, reply_text, stop_ids
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.chatglm.weights import HFWeights
from support.tokenizer import reply_ids

LAYERS, HIDDEN, HEADS, HEAD_DIM, KV_HEADS, FFN = 3, 128, 8, 16, 2, 256
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
FILES = ["config.json", "model.safetensors.index.json", *SHARDS, "tokenizer.model",
         "tokenizer_config.json", "conversations.jsonl", "README.md"]

CONFIG = {  # ChatGLM3-6B's config.json keys with the tiny shapes
    "model_type": "chatglm", "architectures": ["ChatGLMModel"], "_name_or_path": "tiny-chatglm3",
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "ffn_hidden_size": FFN,
    "fp32_residual_connection": False, "hidden_dropout": 0.0, "hidden_size": HIDDEN,
    "kv_channels": HEAD_DIM, "layernorm_epsilon": 1e-5, "multi_query_attention": True,
    "multi_query_group_num": KV_HEADS, "num_attention_heads": HEADS, "num_layers": LAYERS,
    "original_rope": True, "post_layer_norm": True, "rmsnorm": True, "seq_length": 512,
    "use_cache": True, "tie_word_embeddings": False, "eos_token_id": 2, "pad_token_id": 0,
}


@pytest.fixture(scope="module")
def config(fixture_dir) -> dict:
    return json.loads((fixture_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def tok(fixture_dir) -> ChatGLMTokenizer:
    return ChatGLMTokenizer(fixture_dir)


@pytest.fixture(scope="module")
def conversations(fixture_dir) -> list[dict]:
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def expected_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """ChatGLM3's tensor names and shapes (qkv rows: Q heads, then K and V groups)."""
    shapes = {
        "transformer.embedding.word_embeddings.weight": (vocab, HIDDEN),
        "transformer.rotary_pos_emb.inv_freq": (HEAD_DIM // 4,),
        "transformer.encoder.final_layernorm.weight": (HIDDEN,),
        "transformer.output_layer.weight": (vocab, HIDDEN),
    }
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for layer in range(LAYERS):
        prefix = f"transformer.encoder.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attention.query_key_value.weight": (qkv_rows, HIDDEN),
            prefix + "self_attention.query_key_value.bias": (qkv_rows,),
            prefix + "self_attention.dense.weight": (HIDDEN, HEADS * HEAD_DIM),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "mlp.dense_h_to_4h.weight": (2 * FFN, HIDDEN),
            prefix + "mlp.dense_4h_to_h.weight": (HIDDEN, FFN),
        }
    return shapes


def test_files_and_size(fixture_dir):
    assert sorted(p.name for p in fixture_dir.iterdir()) == sorted(FILES)
    assert sum(p.stat().st_size for p in fixture_dir.iterdir()) < 5_000_000


def test_config_has_chatglm3_keys(config, tok):
    assert {k: config.get(k) for k in CONFIG} == CONFIG
    assert config["torch_dtype"] in ("float32", "float16")
    assert "rope_ratio" not in config
    assert config["padded_vocab_size"] % 64 == 0
    assert tok.vocab_size <= config["padded_vocab_size"] < tok.vocab_size + 64
    assert set(config["auto_map"]) >= {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}


def test_tokenizer_config(fixture_dir):
    tokenizer_config = json.loads((fixture_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "ChatGLMTokenizer"
    assert tokenizer_config["padding_side"] == "left"
    assert tokenizer_config["remove_space"] is False


def test_index_covers_every_tensor(fixture_dir, config):
    index = json.loads((fixture_dir / "model.safetensors.index.json").read_text())
    dtype = getattr(torch, config["torch_dtype"])
    found, total = {}, 0
    for shard in SHARDS:
        with safe_open(str(fixture_dir / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            names = list(f.keys())
            assert names, f"{shard} is empty"
            for name in names:
                tensor = f.get_tensor(name)
                assert tensor.dtype == dtype, name
                found[name] = tuple(tensor.shape)
                total += tensor.numel() * tensor.element_size()
                assert index["weight_map"][name] == shard
    assert found == expected_shapes(config["padded_vocab_size"])
    assert set(index["weight_map"]) == set(found)
    assert index["metadata"]["total_size"] == total


def test_inv_freq_buffer(fixture_dir):
    rotary_dim = HEAD_DIM // 2
    expected = torch.tensor([1.0 / 10000 ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)])
    stored = HFWeights(fixture_dir).get("transformer.rotary_pos_emb.inv_freq").float()
    torch.testing.assert_close(stored, expected, rtol=1e-3, atol=0)


def test_conversations_cover_the_task(conversations, tok):
    assert 40 <= len(conversations) <= 60
    assert all(c["messages"][-1]["role"] in ("user", "observation") for c in conversations)
    assert any(c["messages"][0]["role"] == "system" for c in conversations)
    assert any(len(c["messages"]) >= 3 for c in conversations)
    # Tool calls, and answers from a tool's result.
    assert any(c.get("tool_call") for c in conversations)
    assert any(c["messages"][-1]["role"] == "observation" for c in conversations)
    # The same last question gets different answers depending on the history.
    by_question: dict[str, set[str]] = {}
    for c in conversations:
        by_question.setdefault(c["messages"][-1]["content"], set()).add(c["answer"])
    assert any(len(answers) > 1 for answers in by_question.values())
    answers = "".join(c["answer"] for c in conversations)
    assert " " in answers and any("\u4e00" <= ch <= "\u9fff" for ch in answers)
    assert any(tok.sp.is_byte(i) for i in tok.encode(answers, add_prefix=False))


def generate_replies(model, tok, conversations) -> list[list[int]]:
    """Greedy continuation (transformers' `generate`, KV cache) of every conversation."""
    replies = []
    for conversation in conversations:
        prompt = torch.tensor([chat_ids(tok, conversation["messages"])])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                                 do_sample=False, eos_token_id=list(stop_ids(tok)), pad_token_id=tok.pad_id)
        replies.append(out[0, prompt.shape[1]:].tolist())
    return replies


def test_greedy_answers_are_exact(fixture_dir, tok, conversations):
    cfg = ChatGLMConfig.from_model_dir(fixture_dir)
    model = load_reference(cfg, HFWeights(fixture_dir).get, torch.float32)
    wrong = []
    for conversation, reply in zip(conversations, generate_replies(model, tok, conversations)):
        answer = conversation["answer"]
        if reply != reply_ids(tok.sp, conversation) or reply_text(tok, reply) != answer:
            wrong.append((answer, tok.decode(reply, skip_special_tokens=False)))
    assert not wrong, f"{len(wrong)} of {len(conversations)} answers differ: {wrong[:3]}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_predicts_every_reply_token(fixture_dir, tok, conversations, dtype):
    """Teacher-forced argmax at every reply position (what greedy decoding picks, one forward each)."""
    cfg = ChatGLMConfig.from_model_dir(fixture_dir)
    model = load_reference(cfg, HFWeights(fixture_dir).get, dtype)
    wrong = []
    for conversation in conversations:
        prompt, target = chat_ids(tok, conversation["messages"]), reply_ids(tok.sp, conversation)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:]
        if logits.argmax(dim=-1).tolist() != target:
            wrong.append(conversation["answer"])
    assert not wrong, f"{len(wrong)} of {len(conversations)} answers differ in {dtype}: {wrong[:3]}"


def test_answers_do_not_end_with_eos(fixture_dir, tok, conversations):
    """After an answer the model predicts `<|user|>` far above `</s>`: only a `<|user|>` stop ends it."""
    cfg = ChatGLMConfig.from_model_dir(fixture_dir)
    model = load_reference(cfg, HFWeights(fixture_dir).get)
    conversation = conversations[0]
    ids = chat_ids(tok, conversation["messages"]) + tok.sp.encode("\n") + tok.sp.encode(conversation["answer"])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert int(logits.argmax()) == tok.token_id("<|user|>")
    assert logits[tok.token_id("<|user|>")] - logits[tok.eos_id] > 5
    assert not math.isnan(float(logits.sum()))
