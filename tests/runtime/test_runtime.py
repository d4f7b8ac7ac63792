"""trtglm's sharded runtime against transformers' GlmForCausalLM, on checkpoints made by `convert`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.cli_calls import convert_checkpoint

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.weights import HFWeights
from trtglm.errors import ModelFileError, UsageError
from trtglm.request_config import SamplingConfig
from trtglm.runtime.cache import KVCache
from trtglm.runtime.generate import full_logits, generate
from trtglm.runtime.model import load_model
from trtglm.runtime.quant import QuantizedWeight, quantize
from trtglm.runtime.sampling import BadWords, processed

FP32_TOL = 1e-4
LAYER = "transformer.layers.{}."


@pytest.fixture(scope="module")
def hf_cfg(fixture_dir) -> ChatGLMConfig:
    return ChatGLMConfig.from_model_dir(fixture_dir)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, fixture_dir):
    """convert(tp, dtype, weight_only) -> checkpoint folder, converted once per module."""
    made: dict[tuple, Path] = {}

    def convert(tp: int, dtype: str = "float32", weight_only: str | None = None) -> Path:
        key = (tp, dtype, weight_only)
        if key not in made:
            out = tmp_path_factory.mktemp("ckpt") / f"tp{tp}-{dtype}-{weight_only}"
            made[key] = convert_checkpoint(fixture_dir, out, dtype=dtype, tp_size=tp, weight_only=weight_only)
        return made[key]

    return convert


@pytest.fixture(scope="module")
def tokens(hf_cfg) -> list[int]:
    return torch.randint(0, hf_cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def reference_logits(fixture_dir, hf_cfg, tokens) -> torch.Tensor:
    reference = load_reference(hf_cfg, HFWeights(fixture_dir).get, torch.float32)
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# --- logits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_logits_match_reference(converted, tokens, reference_logits, tp):
    model = load_model(converted(tp))
    assert len(model.ranks) == tp
    assert max_diff(full_logits(model, tokens), reference_logits) <= FP32_TOL


def _swap(a: str, b: str | None = None, ranks: tuple[int, int] = (0, 1)):
    """Edit: swap tensor `a` of two ranks, or (with `b`) tensors `a` and `b` within every rank."""
    def edit(tensors: list[dict]) -> None:
        if b is None:
            r, s = ranks
            tensors[r][a], tensors[s][a] = tensors[s][a], tensors[r][a]
        else:
            for t in tensors:
                t[a], t[b] = t[b], t[a]
    return edit


def _fc_as_gate_up(tensors: list[dict]) -> None:
    for t in tensors:
        up, gate = t[LAYER.format(0) + "mlp.fc.weight"].chunk(2)
        t[LAYER.format(0) + "mlp.fc.weight"] = torch.cat([gate, up])


def _scale_rank1_norm(tensors: list[dict]) -> None:
    tensors[1][LAYER.format(1) + "input_layernorm.weight"] = tensors[1][LAYER.format(1) + "input_layernorm.weight"] * 2


WRONG_SPLITS = {
    "fc rows [gate; up]": _fc_as_gate_up,
    "qkv of ranks 0 and 1 swapped": lambda t: (_swap(LAYER.format(0) + "attention.qkv.weight")(t),
                                               _swap(LAYER.format(0) + "attention.qkv.bias")(t)),
    "dense columns of ranks 0 and 1 swapped": _swap(LAYER.format(1) + "attention.dense.weight"),
    "proj columns of ranks 0 and 1 swapped": _swap(LAYER.format(0) + "mlp.proj.weight"),
    "lm_head chunks swapped": _swap("lm_head.weight"),
    "one rank's copy of a norm changed": _scale_rank1_norm,
}


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a checkpoint, applying `edit(list of per-rank tensor dicts)` (or a config edit) on the way."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    tensors = [load_file(str(dst / f"rank{r}.safetensors")) for r in range(config["mapping"]["world_size"])]
    edit(tensors)
    for r, t in enumerate(tensors):
        save_file({k: v.contiguous() for k, v in t.items()}, str(dst / f"rank{r}.safetensors"))
    return dst


@pytest.mark.parametrize("wrong", WRONG_SPLITS)
def test_wrong_split_gives_wrong_logits(converted, tokens, reference_logits, tmp_path, wrong):
    model = load_model(rewrite(converted(2), tmp_path / "bad", WRONG_SPLITS[wrong]))
    assert max_diff(full_logits(model, tokens), reference_logits) > 100 * FP32_TOL


def test_linear_rotary_scaling_divides_positions(converted, tokens, reference_logits, tmp_path):
    """ChatGLM2's rope_ratio: with factor 2, positions 0, 2, 4… rotate as 0, 1, 2… do."""
    ckpt = tmp_path / "scaled"
    shutil.copytree(converted(1), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(chatglm_version="chatglm2", rotary_scaling={"type": "linear", "factor": 2.0})
    (ckpt / "config.json").write_text(json.dumps(config))
    model = load_model(ckpt)
    ids = torch.tensor([tokens])
    cache = KVCache.for_model(model, 1, len(tokens))
    logits = model.forward(ids, cache, positions=2 * torch.arange(len(tokens))[None])[0]
    assert max_diff(logits, reference_logits) <= FP32_TOL
    assert max_diff(full_logits(model, tokens), reference_logits) > 100 * FP32_TOL


def test_rotary_base_comes_from_the_config(converted, fixture_dir, hf_cfg, tokens, tmp_path):
    ckpt = tmp_path / "base"
    shutil.copytree(converted(1), ckpt)
    _edit_config(ckpt, rotary_base=500000.0)  # ChatGLM3-6B-32k's base: 10000 × rope_ratio 50
    reference = load_reference(replace(hf_cfg, rope_ratio=50.0), HFWeights(fixture_dir).get, torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    assert max_diff(full_logits(load_model(ckpt), tokens), expected) <= FP32_TOL


# --- weight-only -----------------------------------------------------------------------------

def fake_quant(w: torch.Tensor, qmax: int) -> torch.Tensor:
    """Symmetric per-row quantization round trip, as documented for TensorRT-LLM's weight-only."""
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    return torch.clamp(torch.round(w / scale), -qmax - 1, qmax) * scale


@pytest.mark.parametrize("weight_only, qmax", [("int8", 127), ("int4", 7)])
def test_weight_only_matches_independent_quantization(converted, fixture_dir, hf_cfg, tokens, reference_logits,
                                                      weight_only, qmax):
    tp = 2
    model = load_model(converted(tp, "float16", weight_only), dtype="float32")  # isolate the quantization
    rank = model.ranks[1]
    assert all(isinstance(w, QuantizedWeight) for w in (rank.layers[0].qkv, rank.layers[0].dense,
                                                          rank.layers[0].fc, rank.layers[0].proj))
    assert all(isinstance(w, torch.Tensor) for w in (rank.embedding, rank.lm_head, rank.final_norm,
                                                      rank.layers[0].qkv_bias, rank.layers[0].input_norm))
    weights = HFWeights(fixture_dir)
    column_chunks = {"query_key_value.weight": 1, "dense_h_to_4h.weight": 1,  # split by rows: scales unchanged
                     "self_attention.dense.weight": tp, "dense_4h_to_h.weight": tp}  # each rank its own scale

    def get(name: str) -> torch.Tensor:
        w = weights.get(name).half().float()  # what the float16 checkpoint holds
        chunks = next((n for suffix, n in column_chunks.items() if name.endswith(suffix)), 0)
        return torch.cat([fake_quant(c, qmax) for c in w.chunk(chunks, dim=1)], dim=1) if chunks else w

    with torch.no_grad():
        expected = load_reference(hf_cfg, get, torch.float32)(torch.tensor([tokens])).logits[0]
    logits = full_logits(model, tokens)
    assert max_diff(logits, expected) <= FP32_TOL
    assert max_diff(logits, reference_logits) > 10 * FP32_TOL  # the quantization is really applied


@pytest.mark.parametrize("algo, qmax", [("W8A16", 127), ("W4A16", 7)])
def test_quantize_range_and_scale(algo, qmax):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q = quantize(w, algo)
    assert q.values.dtype == torch.int8 and q.values.abs().amax(dim=1).eq(qmax).all()
    torch.testing.assert_close(q.scale, w.abs().amax(dim=1) / qmax)
    assert (q.dequantize(torch.float32) - w).abs().le(q.scale[:, None] / 2 + 1e-7).all()


# --- generation ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_tp2(converted):
    return load_model(converted(2))


def greedy_by_reforward(model, prompt: list[int], steps: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(steps):
        sequence.append(int(full_logits(model, sequence)[-1].argmax()))
    return sequence[len(prompt):]


def test_kv_cache_generation_equals_reforward(model_tp2, tokens):
    assert generate(model_tp2, tokens[:10], max_tokens=12) == greedy_by_reforward(model_tp2, tokens[:10], 12)


def test_batch_of_different_lengths_equals_one_by_one(model_tp2, tokens):
    prompts = [tokens[:5], tokens, tokens[3:12]]
    alone = [generate(model_tp2, p, max_tokens=8) for p in prompts]
    assert generate(model_tp2, prompts, max_tokens=8) == alone


def test_stop_ids_and_end_id_stop_without_the_stop_token(model_tp2, tokens):
    free = generate(model_tp2, tokens, max_tokens=12)
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    assert generate(model_tp2, tokens, max_tokens=12, stop_ids=[free[k]]) == free[:k]
    assert generate(model_tp2, tokens, max_tokens=12, end_id=free[k]) == free[:k]
    assert generate(model_tp2, tokens, max_tokens=12, stop_ids=[free[0]]) == []


def test_sampling_is_reproducible_with_a_seed(model_tp2, tokens):
    def sample(seed, **kw):
        return generate(model_tp2, tokens, max_tokens=10, sampling=SamplingConfig(temperature=1.5, seed=seed, **kw))

    assert sample(3) == sample(3)
    assert len({tuple(sample(seed)) for seed in range(4)}) > 1
    greedy = generate(model_tp2, tokens, max_tokens=10)
    assert sample(5, top_k=1) == greedy
    assert sample(5, top_p=1e-6) == greedy


@pytest.mark.parametrize("limit", [{"top_k": 3}, {"top_p": 0.5}])
def test_sampling_stays_within_top_k_and_top_p(model_tp2, tokens, limit):
    new = generate(model_tp2, tokens, max_tokens=12, sampling=SamplingConfig(temperature=3.0, seed=11, **limit))
    logits = full_logits(model_tp2, tokens + new)[len(tokens) - 1:-1]
    probs = torch.softmax(logits / 3.0, dim=-1)
    for row, token in zip(probs, new):
        more_likely = row > row[token]
        if "top_k" in limit:
            assert int(more_likely.sum()) < limit["top_k"]
        else:
            assert float(row[more_likely].sum()) < limit["top_p"]
    assert len(set(new)) > 1  # really sampled


def test_bad_words_ban_a_words_last_token_once_the_rest_was_generated():
    words = BadWords([[7], [3, 4, 5], [9, 5], [8]])
    assert words.banned([1, 2]) == [7, 8]
    assert sorted(words.banned([1, 3, 4])) == [5, 7, 8]
    assert sorted(words.banned([4, 9])) == [5, 7, 8]
    assert words.banned([3, 5, 4]) == [7, 8]


def test_logits_processing_adds_the_bias_then_bans():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float16)
    # a shorter bias, an id past the row; each row its own bans
    out = processed(logits, torch.tensor([0.5, 0.0, -1.0]), banned=[[3, 99], [0]])
    assert out.dtype == torch.float32 and out.tolist() == [[1.5, 2.0, 2.0, float("-inf")], [float("-inf"), 2, 2, 4]]
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0]] * 2  # the model's rows are left as they were
    with pytest.raises(UsageError, match="every token is excluded"):
        processed(logits, None, banned=[[0, 1, 2, 3], []])
    with pytest.raises(UsageError, match="NaN"):
        processed(logits, torch.tensor([float("nan")]), banned=[[], []])


def test_generation_refuses_bad_requests(model_tp2, tokens):
    with pytest.raises(UsageError, match="at least one token"):
        generate(model_tp2, [], max_tokens=4)
    with pytest.raises(UsageError, match="outside the vocabulary"):
        generate(model_tp2, [model_tp2.config.vocab_size], max_tokens=4)
    with pytest.raises(UsageError, match="max_position_embeddings"):
        generate(model_tp2, tokens, max_tokens=model_tp2.config.max_position_embeddings)


# --- bad checkpoints -------------------------------------------------------------------------

def _drop(name: str, rank: int = 0):
    return lambda tensors: tensors[rank].pop(name)


def _reshape(name: str, rank: int = 1):
    def edit(tensors):
        tensors[rank][name] = tensors[rank][name][:-1]
    return edit


def _add(name: str):
    def edit(tensors):
        tensors[0][name] = torch.zeros(4)
    return edit


def _as_int8(name: str):
    def edit(tensors):
        tensors[0][name] = tensors[0][name].to(torch.int8)
    return edit


BAD_TENSORS = {  # edit -> words the one-line message must contain
    "missing tensor": (_drop(LAYER.format(1) + "mlp.proj.weight"),
                       "missing tensor transformer.layers.1.mlp.proj.weight"),
    "wrong shape": (_reshape("lm_head.weight"), "lm_head.weight has shape"),
    "extra tensor": (_add(LAYER.format(0) + "attention.dense.per_channel_scale"), "pre-quantized"),
    "integer weights": (_as_int8(LAYER.format(0) + "mlp.fc.weight"), "expected a float type"),
}


@pytest.mark.parametrize("bad", BAD_TENSORS)
def test_bad_tensors_are_model_file_errors(converted, tmp_path, bad):
    edit, words = BAD_TENSORS[bad]
    ckpt = rewrite(converted(2), tmp_path / "bad", edit)
    with pytest.raises(ModelFileError, match=words) as error:
        load_model(ckpt)
    assert "\n" not in str(error.value)


def _edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))


BAD_FOLDERS = {
    "missing rank file": (lambda c: (c / "rank1.safetensors").unlink(), "rank1.safetensors: rank file not found"),
    "missing config key": (lambda c: _edit_config(c, num_key_value_heads=None), "missing key.*num_key_value_heads"),
    "tp size of another checkpoint": (lambda c: _edit_config(c, mapping={"world_size": 4, "tp_size": 4, "pp_size": 1}),
                                      "rank0.safetensors: tensor .* has shape"),
    "stray rank file": (lambda c: shutil.copy(c / "rank0.safetensors", c / "rank2.safetensors"),
                        "rank2.safetensors does not belong"),
    "unknown dtype": (lambda c: _edit_config(c, dtype="float8"), "dtype 'float8'"),
    "no config": (lambda c: (c / "config.json").unlink(), "config.json: file not found"),
}


@pytest.mark.parametrize("bad", BAD_FOLDERS)
def test_bad_folders_are_model_file_errors(converted, tmp_path, bad):
    spoil, words = BAD_FOLDERS[bad]
    ckpt = tmp_path / "bad"
    shutil.copytree(converted(2), ckpt)
    spoil(ckpt)
    with pytest.raises(ModelFileError, match=words):
        load_model(ckpt)
