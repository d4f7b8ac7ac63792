"""`trtglm convert` end to end through the CLI, checked against independent expectations.

Expected rank tensors are reassembled here from the HF tensors head by head (not with the
converter's split rules); the converted checkpoint is also run through a small
tensor-parallel forward pass written from TensorRT-LLM's documented semantics (rope_gptj,
swiglu, per-rank heads, all-reduce) and compared with transformers' GlmForCausalLM.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import run_cli
from support.cli_calls import convert_checkpoint
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.chatglm.reference import load_reference
from trtglm.chatglm.weights import HFWeights
from trtglm.cli import main
from trtglm.convert import writer
from trtglm.errors import OutputExistsError

TINY = dict(layers=3, hidden=128, heads=8, kv=2, head_dim=16, ffn=256, vocab=512)
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-chatglm3"
    run_cli("synth-model", "--preset", "tiny", "--out", out, "--seed", "7", check=True)
    return out


@pytest.fixture(scope="session")
def tiny_state(tiny_hf) -> dict[str, torch.Tensor]:
    weights = HFWeights(tiny_hf)
    return {name: weights.get(name).clone() for name in weights.names()}


def expected_config(tp: int, dtype: str, quant_algo: str | None) -> dict:
    """TensorRT-LLM's ChatGLM checkpoint config for the tiny model (shared/reference/trtllm.md §1)."""
    return {
        "architecture": "ChatGLMModel", "dtype": dtype, "logits_dtype": "float32",
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_size": 16,
        "hidden_size": 128, "intermediate_size": 256, "norm_epsilon": 1e-5, "vocab_size": 512,
        "position_embedding_type": "rope_gptj", "max_position_embeddings": 512, "hidden_act": "swiglu",
        "use_parallel_embedding": False, "embedding_sharding_dim": 0, "share_embedding_table": False,
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None},
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "chatglm_version": "chatglm3", "add_bias_linear": False, "add_qkv_bias": True,
        "apply_query_key_layer_scaling": False, "apply_residual_connection_post_layernorm": False,
        "rmsnorm": True, "rotary_pct": 0.5, "rotary_base": 10000.0, "rotary_scaling": None,
    }


def expected_rank(hf: dict[str, torch.Tensor], tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank `rank`'s TensorRT-LLM tensors, built head by head from the HF tensors."""
    heads, kv, d, ffn, vocab = TINY["heads"], TINY["kv"], TINY["head_dim"], TINY["ffn"], TINY["vocab"]
    my_heads = list(range(rank * heads // tp, (rank + 1) * heads // tp))
    my_kv = sorted({h * kv // heads for h in my_heads})  # the KV group of each of my query heads

    def qkv(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t[:heads * d], t[heads * d:(heads + kv) * d], t[(heads + kv) * d:]
        block = lambda x, h: x[h * d:(h + 1) * d]  # noqa: E731
        return torch.cat([block(q, h) for h in my_heads] + [block(k, h) for h in my_kv] + [block(v, h) for h in my_kv])

    ffn_part = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
    my_features = slice(my_heads[0] * d, (my_heads[-1] + 1) * d)  # attention outputs of my heads
    out = {
        "transformer.vocab_embedding.weight": hf["transformer.embedding.word_embeddings.weight"],
        "transformer.ln_f.weight": hf["transformer.encoder.final_layernorm.weight"],
        "lm_head.weight": hf["transformer.output_layer.weight"][rank * vocab // tp:(rank + 1) * vocab // tp],
    }
    for layer in range(TINY["layers"]):
        src, dst = f"transformer.encoder.layers.{layer}.", f"transformer.layers.{layer}."
        gate, up = hf[src + "mlp.dense_h_to_4h.weight"].chunk(2)
        out |= {
            dst + "input_layernorm.weight": hf[src + "input_layernorm.weight"],
            dst + "attention.qkv.weight": qkv(hf[src + "self_attention.query_key_value.weight"]),
            dst + "attention.qkv.bias": qkv(hf[src + "self_attention.query_key_value.bias"]),
            dst + "attention.dense.weight": hf[src + "self_attention.dense.weight"][:, my_features],
            dst + "post_layernorm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "mlp.fc.weight": torch.cat([up[ffn_part], gate[ffn_part]]),
            dst + "mlp.proj.weight": hf[src + "mlp.dense_4h_to_h.weight"][:, ffn_part],
        }
    return {name: t.to(dtype) for name, t in out.items()}


def convert(model: Path, out: Path, *flags: str) -> dict:
    run_cli("convert", "--model-dir", model, "--output-dir", out, *flags, check=True)
    return json.loads((out / "config.json").read_text())


@dataclass
class Result:
    returncode: int
    stderr: str


def cli(*args: object) -> Result:
    """`trtglm ARGS` through the CLI's own entry point, in this process (no interpreter start-up)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return Result(code, stderr.getvalue())


@pytest.fixture(scope="session")
def converted(tiny_hf, tmp_path_factory):
    """Checkpoint folder for a set of convert flags, converted once per session through the CLI."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(*flags: str) -> Path:
        if flags not in cache:
            out = tmp_path_factory.mktemp("ckpt") / "ckpt"
            convert(tiny_hf, out, *flags)
            cache[flags] = out
        return cache[flags]

    return get


def assert_one_line_error(proc, *fragments: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(out.name + ".*")), list(out.parent.iterdir())


@pytest.mark.parametrize("tp,dtype,weight_only", [
    (1, "float16", None), (2, "float32", None), (4, "bfloat16", None), (8, "float32", None),
    (1, "float16", "int8"), (2, "bfloat16", "int4"),
])
def test_convert_matches_independent_reassembly(converted, tiny_state, tp, dtype, weight_only):
    flags = ["--tp-size", str(tp), "--dtype", dtype] + (["--weight-only", weight_only] if weight_only else [])
    ckpt = converted(*flags)
    config = json.loads((ckpt / "config.json").read_text())
    assert config == expected_config(tp, dtype, {None: None, "int8": "W8A16", "int4": "W4A16"}[weight_only])
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp)]
    for rank in range(tp):
        expected = expected_rank(tiny_state, tp, rank, TORCH_DTYPES[dtype])
        with safe_open(ckpt / f"rank{rank}.safetensors", framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert sorted(f.keys()) == sorted(expected)
            assert len(expected) == 3 + 7 * TINY["layers"]
            for name, tensor in expected.items():
                got = f.get_tensor(name)
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_dtype_auto_is_the_hf_torch_dtype(tiny_hf, tmp_path):
    assert cli("convert", "--model-dir", tiny_hf, "--output-dir", tmp_path / "ckpt").returncode == 0
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "float16"


# ---- the converted checkpoint computes what GlmForCausalLM computes ----------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_gptj(x: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Rotate adjacent pairs (x0,x1),(x2,x3)… of the first rotary_dim dims; x is [seq, heads, dim]."""
    positions = torch.arange(x.shape[0], dtype=torch.float64)[:, None]
    freqs = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    cos, sin = (positions * freqs).cos()[:, None].float(), (positions * freqs).sin()[:, None].float()
    even, odd = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def tp_forward(ranks: list[dict[str, torch.Tensor]], config: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a TensorRT-LLM ChatGLM checkpoint, computed rank by rank with sums as all-reduce."""
    tp, d, eps = len(ranks), config["head_size"], config["norm_epsilon"]
    rotary_dim = int(d * config["rotary_pct"])
    x = ranks[0]["transformer.vocab_embedding.weight"][ids]
    seq = len(ids)
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    for layer in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{layer}."
        h = rms_norm(x, ranks[0][p + "input_layernorm.weight"], eps)
        attention = 0
        for w in ranks:
            qkv = h @ w[p + "attention.qkv.weight"].T + w[p + "attention.qkv.bias"]
            n_q = config["num_attention_heads"] // tp
            n_kv = (qkv.shape[-1] // d - n_q) // 2
            q, k, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
            q = rope_gptj(q.view(seq, n_q, d), rotary_dim, config["rotary_base"])
            k = rope_gptj(k.view(seq, n_kv, d), rotary_dim, config["rotary_base"])
            k, v = (t.repeat_interleave(n_q // n_kv, dim=1) for t in (k, v.view(seq, n_kv, d)))
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + causal
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, n_q * d)
            attention = attention + out @ w[p + "attention.dense.weight"].T
        x = x + attention
        h = rms_norm(x, ranks[0][p + "post_layernorm.weight"], eps)
        mlp = 0
        for w in ranks:
            up, gate = (h @ w[p + "mlp.fc.weight"].T).chunk(2, dim=-1)  # TensorRT-LLM swiglu: silu(2nd) * 1st
            mlp = mlp + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.proj.weight"].T
        x = x + mlp
    x = rms_norm(x, ranks[0]["transformer.ln_f.weight"], eps)
    return torch.cat([x @ w["lm_head.weight"].T for w in ranks], dim=-1)


def assert_same_function(model_dir: Path, ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    ranks = [load_file(ckpt / f"rank{r}.safetensors") for r in range(config["mapping"]["tp_size"])]
    weights = HFWeights(model_dir)
    reference = load_reference(ChatGLMConfig.from_model_dir(model_dir), weights.get, torch.float32)
    ids = torch.tensor([1, 5, 17, 300, 42, 9, 77, 2, 64, 128, 3, 250])
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = tp_forward(ranks, config, ids)
    assert expected.abs().max() > 1e-3  # not a degenerate comparison
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_converted_checkpoint_computes_glm_logits(tiny_hf, converted, tp):
    assert_same_function(tiny_hf, converted("--tp-size", str(tp), "--dtype", "float32"))


def test_fixture_model_converts_to_the_same_function(fixture_dir, tmp_path):
    convert(fixture_dir, tmp_path / "ckpt", "--tp-size", "2", "--dtype", "float32")
    assert_same_function(fixture_dir, tmp_path / "ckpt")


# ---- input formats --------------------------------------------------------------------

def test_bin_input_with_and_without_index_gives_identical_output(tiny_hf, tiny_state, tmp_path):
    bin_dir = tmp_path / "tiny-chatglm3-bin"
    assert cli("synth-model", "--preset", "tiny", "--out", bin_dir, "--format", "bin", "--seed", "7").returncode == 0
    assert (bin_dir / "pytorch_model.bin.index.json").exists()
    no_index = tmp_path / "tiny-chatglm3-bin-noindex"
    shutil.copytree(bin_dir, no_index)
    (no_index / "pytorch_model.bin.index.json").unlink()
    single = tmp_path / "tiny-chatglm3-single"  # one safetensors file, no index
    single.mkdir()
    shutil.copy(tiny_hf / "config.json", single)
    save_file(tiny_state, single / "model.safetensors")
    outputs = {}
    for model in (tiny_hf, bin_dir, no_index, single):
        convert_checkpoint(model, tmp_path / f"{model.name}.ckpt", tp_size=2)
        ckpt = tmp_path / f"{model.name}.ckpt"
        outputs[model.name] = [(ckpt / f"rank{r}.safetensors").read_bytes() for r in range(2)]
    assert outputs[bin_dir.name] == outputs[tiny_hf.name]
    assert outputs[no_index.name] == outputs[tiny_hf.name]
    assert outputs[single.name] == outputs[tiny_hf.name]


# ---- bad input: one line, non-zero exit, nothing written ------------------------------

def copy_model(tiny_hf: Path, dest: Path) -> Path:
    shutil.copytree(tiny_hf, dest)
    return dest


def rewrite_shard(model: Path, edit) -> None:
    """Apply `edit(tensors)` to the shard holding the output layer and fix the index."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model / index["weight_map"]["transformer.output_layer.weight"]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in tensors or f != shard.name}
    index["weight_map"].update({n: shard.name for n in tensors})
    index_path.write_text(json.dumps(index))


def _missing_tensor(model: Path) -> None:
    rewrite_shard(model, lambda t: t.pop("transformer.output_layer.weight"))


def _wrong_shape(model: Path) -> None:
    wrong = torch.zeros(500, 128, dtype=torch.float16)
    rewrite_shard(model, lambda t: t.update({"transformer.output_layer.weight": wrong}))


def _unexpected_tensor(model: Path) -> None:
    rewrite_shard(model, lambda t: t.update({"transformer.extra.weight": torch.zeros(3, dtype=torch.float16)}))


def _truncated_shard(model: Path) -> None:
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])


def _no_config(model: Path) -> None:
    (model / "config.json").unlink()


def _bad_config(model: Path) -> None:
    (model / "config.json").write_text("{not json")


@pytest.mark.parametrize("damage,fragments", [
    (_no_config, ["config.json", "not found"]),
    (_bad_config, ["config.json", "not valid JSON"]),
    (_truncated_shard, ["truncated"]),
    (_missing_tensor, ["missing: transformer.output_layer.weight"]),
    (_wrong_shape, ["wrong shape: transformer.output_layer.weight [500, 128] (expected [512, 128])"]),
    (_unexpected_tensor, ["unexpected: transformer.extra.weight"]),
])
def test_bad_model_is_refused_before_writing(tiny_hf, tmp_path, damage, fragments):
    model = copy_model(tiny_hf, tmp_path / "tiny-chatglm3")
    damage(model)
    out = tmp_path / "ckpt"
    assert_one_line_error(cli("convert", "--model-dir", model, "--output-dir", out), *fragments)
    assert_nothing_left(out)


def test_truncated_bin_shard_is_refused(tiny_hf, tmp_path):
    model = tmp_path / "tiny-chatglm3-bin"
    assert cli("synth-model", "--preset", "tiny", "--out", model, "--format", "bin").returncode == 0
    shard = sorted(model.glob("*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:len(shard.read_bytes()) // 2])
    out = tmp_path / "ckpt"
    assert_one_line_error(cli("convert", "--model-dir", model, "--output-dir", out), shard.name, "cannot read")
    assert_nothing_left(out)


@pytest.mark.parametrize("flags,fragments", [
    (["--pp-size", "2"], ["--pp-size must be 1"]),
    (["--tp-size", "3"], ["--tp-size must be one of 1, 2, 4, 8"]),
    (["--tp-size", "16"], ["--tp-size must be one of 1, 2, 4, 8"]),
    (["--dtype", "float32", "--weight-only", "int8"], ["--weight-only int8 needs --dtype float16 or bfloat16"]),
    (["--dtype", "float8"], ["--dtype must be"]),
    (["--weight-only", "int2"], ["--weight-only must be one of int8, int4, not 'int2'"]),
    (["--chatglm-version", "glm4"], ["--chatglm-version"]),
])
def test_bad_options_are_refused(tiny_hf, tmp_path, flags, fragments):
    out = tmp_path / "ckpt"
    assert_one_line_error(cli("convert", "--model-dir", tiny_hf, "--output-dir", out, *flags), *fragments)
    assert_nothing_left(out)


def test_errors_from_a_real_process(tiny_hf, tmp_path):
    """The in-process runs above use the CLI's entry point; these two go through a new interpreter."""
    out = tmp_path / "ckpt"
    proc = run_cli("convert", "--model-dir", tmp_path / "nowhere", "--output-dir", out)
    assert_one_line_error(proc, "nowhere", "model folder not found")
    assert proc.returncode == 3
    proc = run_cli("convert", "--model-dir", tiny_hf, "--output-dir", out, "--pp-size", "2")
    assert_one_line_error(proc, "--pp-size must be 1")
    assert proc.returncode == 2
    assert_nothing_left(out)


def test_tp_that_does_not_divide_the_heads(tiny_hf, tmp_path):
    """tp 8 is valid for TensorRT-LLM but a model with 4 heads cannot be split 8 ways."""
    model = copy_model(tiny_hf, tmp_path / "tiny-chatglm3")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4, "kv_channels": 32}))
    out = tmp_path / "ckpt"
    assert_one_line_error(cli("convert", "--model-dir", model, "--output-dir", out, "--tp-size", "8"),
                          "--tp-size 8 does not divide the number of attention heads (4)")
    assert_nothing_left(out)


# ---- existing output, --force, interruption -------------------------------------------

def test_existing_output_needs_force(tiny_hf, tmp_path):
    out = tmp_path / "ckpt"
    assert cli("convert", "--model-dir", tiny_hf, "--output-dir", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = cli("convert", "--model-dir", tiny_hf, "--output-dir", out, "--tp-size", "2")
    assert_one_line_error(result, "already exists", "--force")
    assert result.returncode == 4
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert cli("convert", "--model-dir", tiny_hf, "--output-dir", out, "--tp-size", "2", "--force").returncode == 0
    assert json.loads((out / "config.json").read_text())["mapping"]["tp_size"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_force_never_replaces_a_folder_that_is_not_a_checkpoint(tiny_hf, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="not a TensorRT-LLM checkpoint"):
        convert_checkpoint(tiny_hf, out, force=True)
    with pytest.raises(OutputExistsError, match="not a TensorRT-LLM checkpoint"):
        convert_checkpoint(tiny_hf, tiny_hf, force=True)
    assert (out / "notes.txt").read_text() == "keep me"


def interrupt_after(monkeypatch, n_tensors: int, exc: BaseException) -> None:
    real = writer.copy_tensor
    calls = []

    def copy_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) > n_tensors:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "copy_tensor", copy_then_interrupt)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_interrupted_conversion_leaves_nothing(tiny_hf, tmp_path, monkeypatch, exc):
    interrupt_after(monkeypatch, 5, exc)
    out = tmp_path / "ckpt"
    with pytest.raises(type(exc)):
        convert_checkpoint(tiny_hf, out, tp_size=2)
    assert_nothing_left(out)


def test_interrupted_forced_conversion_keeps_the_old_output(tiny_hf, tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    convert_checkpoint(tiny_hf, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    interrupt_after(monkeypatch, 5, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny_hf, out, tp_size=4, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_output_is_the_same_without_kernel_copies(tiny_hf, tmp_path, monkeypatch):
    """Where copy_file_range is refused (other file systems), the read/write path gives the same bytes."""
    convert_checkpoint(tiny_hf, tmp_path / "kernel", tp_size=2)

    def refuse(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    convert_checkpoint(tiny_hf, tmp_path / "blocks", tp_size=2)
    for name in ("config.json", "rank0.safetensors", "rank1.safetensors"):
        assert (tmp_path / "kernel" / name).read_bytes() == (tmp_path / "blocks" / name).read_bytes()


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_rerun_cleans_up_after_a_conversion_killed_midway(tmp_path, fixture_dir):
    import subprocess
    import sys

    out, pid = tmp_path / "ckpt", _dead_pid()
    stale = tmp_path / f"ckpt.tmp-{pid}"
    (stale / "part").mkdir(parents=True)  # what a SIGKILLed conversion leaves
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = tmp_path / f"ckpt.tmp-{other.pid}"  # a conversion still running: not ours to touch
    running.mkdir()
    try:
        convert_checkpoint(fixture_dir, out, dtype="float32")
    finally:
        other.kill()
        other.wait()
    assert not stale.exists() and (out / "config.json").is_file()
    assert running.is_dir()
    running.rmdir()

    moved_aside = tmp_path / f"ckpt.old-{pid}"  # killed between moving the old output aside and the swap
    out.rename(moved_aside)
    convert_checkpoint(fixture_dir, out, dtype="float32", force=True)
    assert not moved_aside.exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
