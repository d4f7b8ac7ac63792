"""FP8 checkpoints in the runtimes: the dequantized reference (ShardedModel) keeps the fixture's answers, checkpoints
with bad scales are refused in one line, the fast runtime refuses FP8 where no FP8 tensor cores are, and its FP8
arithmetic (emulated on the CPU, a stand-in for the tensor cores: the same function in float32) computes the
reference's function through every pass, the FP8 KV cache included, and serves the fixture's chats exactly.

On a GPU (the tests named `cuda`, which scripts/bench_gpu.sh's fp8 part runs): torch._scaled_mm and the FP8 Triton
kernels (input quantization, the FP8 KV cache's writes and reads) against the emulation, the whole fast model with
its CUDA graphs against the reference, and the fixture's chats served exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.cli_calls import convert_checkpoint
from support.references import reordered_float32_atol
from trtglm.chatglm import chat
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.cli import main
from trtglm.errors import ModelFileError, UsageError
from trtglm.runtime.checkpoint import load_checkpoint
from trtglm.runtime.executor import Executor
from trtglm.runtime.fast import load_fast_model
from trtglm.runtime.fast.linear import Linear, fp8_problem
from trtglm.runtime.generate import full_logits, generate
from trtglm.runtime.model import load_model
from trtglm.runtime.quant import fp8_linear, to_fp8
from trtglm.runtime.request import Request
from trtglm.runtime.slot_runtime import ShardedSlotModel

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
FP8_GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs a GPU with FP8 tensor cores (compute capability 8.9)")
SMALL = {"num_slots": 4, "max_seq_len": 96, "block_size": 16}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, fixture_dir):
    """convert(dtype, tp, kv) -> the fixture's FP8 checkpoint, converted once per module."""
    made: dict[tuple, Path] = {}

    def convert(dtype: str = "bfloat16", tp: int = 1, kv: bool = True) -> Path:
        if (dtype, tp, kv) not in made:
            out = tmp_path_factory.mktemp("fp8") / f"{dtype}-tp{tp}-{kv}"
            made[dtype, tp, kv] = convert_checkpoint(fixture_dir, out, dtype=dtype, tp_size=tp, fp8=True,
                                                     fp8_kv_cache=kv)
        return made[dtype, tp, kv]

    return convert


@pytest.fixture(scope="module")
def chats(fixture_dir) -> tuple[ChatGLMTokenizer, list[list[int]], list[str]]:
    tokenizer = ChatGLMTokenizer(fixture_dir)
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    conversations = [json.loads(line) for line in lines if line.strip()]
    return tokenizer, [chat.chat_ids(tokenizer, c["messages"]) for c in conversations], \
        [c["answer"] for c in conversations]


def longest(tokenizer, answers: list[str]) -> int:
    """New tokens enough for every answer and its stop."""
    return max(len(tokenizer.encode(answer, add_prefix=False)) for answer in answers) + 8


def wrong_answers(tokenizer, replies, answers) -> list[tuple[str, str]]:
    return [(answer, chat.reply_text(tokenizer, reply)) for reply, answer in zip(replies, answers)
            if chat.reply_text(tokenizer, reply) != answer]


# --- the dequantized reference ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tp, kv", [("bfloat16", 1, True), ("bfloat16", 2, False), ("float16", 2, True)])
def test_dequantized_reference_keeps_the_fixtures_answers(fp8_checkpoint, chats, dtype, tp, kv):
    tokenizer, prompts, answers = chats
    model = load_model(fp8_checkpoint(dtype, tp, kv))
    replies = generate(model, prompts, max_tokens=longest(tokenizer, answers), stop_ids=chat.stop_ids(tokenizer))
    wrong = wrong_answers(tokenizer, replies, answers)
    assert not wrong, f"{len(wrong)}/{len(answers)} wrong, e.g. {wrong[0]}"


def test_the_reference_quantizes_inputs_weights_and_kv_cache(fp8_checkpoint, fixture_dir, tmp_path):
    """FP8 is not a no-op: the logits move from the unquantized checkpoint's, and more with the FP8 KV cache too."""
    plain = load_model(convert_checkpoint(fixture_dir, tmp_path / "bf16", dtype="bfloat16"), dtype="float32")
    ids = list(range(5, 60))
    reference = full_logits(plain, ids)
    moved = [float((full_logits(load_model(fp8_checkpoint(kv=kv), dtype="float32"), ids) - reference).abs().max())
             for kv in (False, True)]
    assert 0 < moved[0] < 0.2 * float(reference.abs().max()) and moved[1] != moved[0]


def _rewrite(folder: Path, change) -> None:
    tensors = load_file(str(folder / "rank0.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "rank0.safetensors"), metadata={"format": "pt"})


SCALE = "transformer.layers.1.mlp.fc.activation_scaling_factor"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop(SCALE), f"missing tensor {SCALE}"),
    (lambda t: t.pop("transformer.layers.0.attention.kv_cache_scaling_factor"), "kv_cache_scaling_factor"),
    (lambda t: t.update({SCALE: torch.tensor([float("nan")])}), f"scale {SCALE} is [nan], not a positive finite"),
    (lambda t: t.update({SCALE: torch.tensor([float("inf")])}), "is [inf], not a positive finite number"),
    (lambda t: t.update({SCALE: torch.tensor([0.0])}), "is [0.0], not a positive finite number"),
    (lambda t: t.update({SCALE: torch.tensor([0.5, 0.5])}), "has shape (2,), expected (1,)"),
    (lambda t: t.update({SCALE: torch.tensor([0.5], dtype=torch.float16)}), "dtype torch.float16, expected float32"),
    (lambda t: t.update({"transformer.layers.0.mlp.proj.weight":
                         t["transformer.layers.0.mlp.proj.weight"].to(torch.bfloat16)}),
     "expected float8_e4m3fn (quant_algo FP8)"),
])
def test_checkpoints_with_bad_scales_are_refused_in_one_line(fp8_checkpoint, fixture_dir, tmp_path, capsys, change,
                                                             message):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_checkpoint(), bad)
    _rewrite(bad, change)
    with pytest.raises(ModelFileError) as refused:
        load_checkpoint(bad)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(SystemExit) as exited:  # as a command: one line, its exit code
        main(["chat", "--checkpoint", str(bad), "--tokenizer-dir", str(fixture_dir), "--prompt", "hi"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == ModelFileError.exit_code and last.startswith("trtglm: error:") and message in last


def test_int8_stored_fp8_weights_are_read_as_fp8(fp8_checkpoint, tmp_path):
    """TensorRT-LLM reads FP8 weights stored as int8 too (modeling_utils.py's preprocess_weights views them)."""
    ckpt = tmp_path / "int8"
    shutil.copytree(fp8_checkpoint(), ckpt)
    name = "transformer.layers.2.attention.qkv.weight"
    _rewrite(ckpt, lambda t: t.update({name: t[name].view(torch.int8)}))
    assert torch.equal(load_checkpoint(ckpt).ranks[0][name].view(torch.uint8),
                       load_checkpoint(fp8_checkpoint()).ranks[0][name].view(torch.uint8))


def test_unsupported_kv_cache_quantization_is_refused(fp8_checkpoint, tmp_path):
    ckpt = tmp_path / "int8kv"
    shutil.copytree(fp8_checkpoint(), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"]["kv_cache_quant_algo"] = "INT8"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="kv_cache_quant_algo 'INT8' is not supported"):
        load_checkpoint(ckpt)


# --- the fast runtime -------------------------------------------------------------------------------------------------

def fp8_kv_cache_only(fixture_dir: Path, out: Path) -> Path:
    """An unquantized bfloat16 checkpoint with an FP8 KV cache (kv_cache_quant_algo FP8 and its scales)."""
    ckpt = convert_checkpoint(fixture_dir, out, dtype="bfloat16")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"]["kv_cache_quant_algo"] = "FP8"
    (ckpt / "config.json").write_text(json.dumps(config))
    _rewrite(ckpt, lambda t: t.update({f"transformer.layers.{layer}.attention.kv_cache_scaling_factor":
                                       torch.tensor([1.0]) for layer in range(3)}))
    return ckpt


def test_fast_runtime_refuses_fp8_without_fp8_tensor_cores(fp8_checkpoint, fixture_dir, tmp_path, monkeypatch):
    with pytest.raises(UsageError, match=r"compute capability 8.9 or later \(Ada, Hopper\), and the cpu has no FP8"):
        load_fast_model(fp8_checkpoint(), device="cpu", **SMALL)
    with pytest.raises(UsageError, match="the checkpoint has an FP8 KV cache"):
        load_fast_model(fp8_kv_cache_only(fixture_dir, tmp_path / "kv"), device="cpu", **SMALL)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert fp8_problem(torch.device("cuda", 0)) == \
        "NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor cores"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_problem(torch.device("cuda", 0)) is None


def test_weight_only_is_refused_for_fp8_weights(fp8_checkpoint):
    with pytest.raises(UsageError, match="weights are FP8"):
        load_fast_model(fp8_checkpoint(), device="cpu", weight_only="int8", emulate_fp8=True, **SMALL)


def sequences(vocab: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


class Agreement:
    """Rows of logits against the reference's. FP8 rounds every matmul's input: where another order of float32
    additions moves an input element across an FP8 rounding boundary, the element moves by one FP8 step (up to an
    eighth of it) and the logits by far more than reordering alone would move them (on the fixture up to ~1% of their
    largest). So most rows must agree to float32 reordering's tolerance (`exact`), and every row within `flipped` of
    the largest logit with the reference's top token: a wrong scale or cache moves every row by far more."""

    def __init__(self, atol: float, scale: float, exact: float, flipped: float = 0.03):
        self.atol, self.bound, self.exact = atol, flipped * scale, exact
        self.diffs: list[float] = []
        self.same_top: list[bool] = []

    def add(self, row: torch.Tensor, reference: torch.Tensor) -> None:
        row = row.cpu()
        self.diffs.append(float((row - reference).abs().max()))
        self.same_top.append(int(row.argmax()) == int(reference.argmax()))

    def check(self) -> None:
        close = sum(d <= self.atol for d in self.diffs)
        assert close >= self.exact * len(self.diffs) and max(self.diffs) <= self.bound and all(self.same_top), \
            (self.diffs, self.same_top)


def check_passes(fast, reference, agreement: float, atol=None) -> None:
    """One-prompt and grouped prefills, a chunk after cached positions, decode steps over changing slots and a mixed
    step of `fast` against the reference's logits (see Agreement)."""
    seqs = sequences(fast.vocab_size, [40, 40, 40])
    expected = [full_logits(reference, s) for s in seqs]
    rows = Agreement(atol or reordered_float32_atol(fast.config, expected[0]), float(expected[0].abs().max()),
                     agreement)
    rows.add(fast.score(seqs[0])[-1], expected[0][-1])
    prefilled = fast.prefill([0, 1], [seqs[0][:20], seqs[1][:11]])
    rows.add(prefilled[0], expected[0][19])
    rows.add(prefilled[1], expected[1][10])
    rows.add(fast.prefill([2], [seqs[2][:9]])[0], expected[2][8])
    rows.add(fast.prefill([2], [seqs[2][9:25]], starts=[9])[0], expected[2][24])  # a chunk after cached positions
    position = {0: 20, 1: 11, 2: 25}
    for step in ([0, 1, 2], [2], [1, 0], [0]):
        for row, slot in zip(fast.decode(step, [seqs[s][position[s]] for s in step]), step):
            rows.add(row, expected[slot][position[slot]])
            position[slot] += 1
    logits = fast.step([0, 1], [[seqs[0][position[0]]], seqs[1][position[1]:position[1] + 5]],
                       [position[0], position[1]])
    rows.add(logits[0], expected[0][position[0]])
    rows.add(logits[1], expected[1][position[1] + 4])
    rows.check()
    for slot in range(3):
        fast.release(slot)


ODD_KV_SCALE = 0.03  # the fixture's own KV scales are ModelOpt's floor, 1.0: one forgotten anywhere would not show


@pytest.fixture(scope="module")
def odd_kv_scale(fp8_checkpoint, tmp_path_factory) -> Path:
    """The FP8 checkpoint with every layer's KV-cache scale ODD_KV_SCALE (valid: values past 448 × it saturate)."""
    ckpt = tmp_path_factory.mktemp("odd") / "kv"
    shutil.copytree(fp8_checkpoint(kv=True), ckpt)
    _rewrite(ckpt, lambda t: t.update({name: torch.tensor([ODD_KV_SCALE]) for name in t
                                       if name.endswith("kv_cache_scaling_factor")}))
    return ckpt


@pytest.mark.parametrize("kv", [False, True], ids=["kv16", "kv8"])
def test_emulated_fast_passes_compute_the_references_function(fp8_checkpoint, odd_kv_scale, kv):
    """In float32 (only the order of additions differs from the dequantized reference's)."""
    path = odd_kv_scale if kv else fp8_checkpoint(kv=False)
    fast = load_fast_model(path, device="cpu", dtype="float32", emulate_fp8=True, **SMALL)
    assert fast.cache.keys[0].dtype == (torch.float8_e4m3fn if kv else torch.float32)
    assert fast.cache.scales == pytest.approx([ODD_KV_SCALE if kv else 1.0] * 3)
    assert fast.kv_bytes_per_position == 2 * 3 * 2 * 16 * (1 if kv else 4)
    check_passes(fast, load_model(path, dtype="float32"), agreement=0.5)


def serve(model, prompts: list[list[int]], tokenizer, new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """Every prompt through the in-flight executor at once (greedy, stopping where ChatGLM3's chats do)."""
    executor = Executor(model, max_queue=len(prompts), max_num_tokens=64, device=device)
    stops = [[i] for i in chat.stop_ids(tokenizer)[1:]]
    replies: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        executor.submit(Request(prompt, new_tokens, end_id=tokenizer.eos_id, stop_words=stops),
                        lambda out, i=i: replies[i].extend(out.tokens))
    while executor.has_work():
        executor.step()
    return replies


def test_portable_runtime_serves_the_fixtures_chats_exactly(fp8_checkpoint, chats):
    """The executor over the dequantized reference (how FP8 engines serve on a CPU), tp 2, FP8 KV cache."""
    tokenizer, prompts, answers = chats
    model = ShardedSlotModel(load_model(fp8_checkpoint("bfloat16", 2, True)), num_slots=8, max_seq_len=256)
    wrong = wrong_answers(tokenizer, serve(model, prompts, tokenizer, longest(tokenizer, answers)), answers)
    assert not wrong, f"{len(wrong)}/{len(answers)} wrong, e.g. {wrong[0]}"


def test_emulated_fast_runtime_serves_the_fixtures_chats_exactly(fp8_checkpoint, chats):
    tokenizer, prompts, answers = chats
    model = load_fast_model(fp8_checkpoint(), device="cpu", emulate_fp8=True, num_slots=8, max_seq_len=256,
                            block_size=16)
    wrong = wrong_answers(tokenizer, serve(model, prompts, tokenizer, longest(tokenizer, answers)), answers)
    assert not wrong, f"{len(wrong)}/{len(answers)} wrong, e.g. {wrong[0]}"


# --- on a GPU with FP8 tensor cores ----------------------------------------------------------------------------------

@FP8_GPU
@pytest.mark.parametrize("rows", [1, 8, 256])
@pytest.mark.parametrize("swiglu", [False, True])
def test_quantize_kernel_is_to_fp8_cuda(rows, swiglu):
    from trtglm.runtime.fast import kernels

    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2 * 4096 if swiglu else 4096, device="cuda", dtype=torch.bfloat16, generator=generator) * 3
    scale = torch.tensor(0.01, device="cuda")  # some inputs beyond 448 × scale: saturated
    if swiglu:
        up, gate = x.float().chunk(2, dim=-1)
        expected = to_fp8((torch.nn.functional.silu(gate) * up).to(x.dtype), scale)
    else:
        expected = to_fp8(x, scale)
    got = kernels.quantize_fp8(x, scale, swiglu)
    assert got.dtype == torch.float8_e4m3fn and got.shape == expected.shape
    if not swiglu:  # the same IEEE division and round-to-nearest-even conversion: the same bytes
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        return
    # silu in Triton and in torch may differ in float32's last bit, and now and then that tips an FP8 rounding
    differ = got.view(torch.uint8) != expected.view(torch.uint8)
    step = expected.float().abs() * 2**-3 + 2**-9  # one e4m3 step (3 mantissa bits), or a subnormal's
    assert differ.float().mean() < 1e-3 and ((got.float() - expected.float()).abs() <= step).all()


@FP8_GPU
@pytest.mark.parametrize("slots, positions", [([2], [0]), ([1], [300]), ([3], [599]), ([0, 3, 1], [5, 599, 256])])
def test_fp8_kv_cache_kernels_match_their_definitions_cuda(slots, positions):
    """The attention kernels over an FP8 cache of scale 0.03 against TorchOps: the new keys and values written as the
    same bytes, the attention alike (rope_attention at one sequence, rope_cache and decode_attention at several)."""
    from trtglm.runtime.fast import kernels
    from trtglm.runtime.fast.ops import TorchOps

    g = torch.Generator().manual_seed(1)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16).cuda()

    heads, kv_heads, head, length, block, scale = 8, 2, 128, 600, 16, 0.03
    angles = torch.arange(length)[:, None].float() * 0.1 ** torch.arange(32).float()
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    per_slot = -(-length // block)
    table = (torch.randperm(4 * per_slot, generator=g) + 1).view(4, per_slot).to(torch.int32).cuda()
    caches = [to_fp8(rnd(1 + 4 * per_slot, kv_heads, block, head), scale) for _ in range(2)]
    copies = [c.clone() for c in caches]
    qkv = rnd(len(slots), (heads + 2 * kv_heads) * head)
    slots = torch.tensor(slots, device="cuda")
    positions = torch.tensor(positions, dtype=torch.int32, device="cuda")
    got = kernels.decode_qkv_attention(qkv, slots, positions, cos, sin, *caches, table, heads, scale)
    want = TorchOps.decode_qkv_attention(qkv, slots, positions, cos, sin, *copies, table, heads, scale)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, copies))


def _fp8_layer(out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
               generator: torch.Generator) -> Linear:
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator) * 0.02
    scale = weight.abs().max() / 448
    bias_tensor = torch.randn(out_features, device="cuda", generator=generator).to(dtype) if bias else None
    return Linear.from_fp8(to_fp8(weight, scale), scale, torch.tensor(0.02, device="cuda"), bias_tensor, dtype,
                           emulate=False)


@FP8_GPU
@pytest.mark.parametrize("rows", [1, 16, 333])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_matches_the_emulated_product_cuda(rows, dtype):
    """torch._scaled_mm against the same product in float32, on 6B-shaped layers: fc (with a bias) and proj (its
    input SwiGLU's of [up; gate] rows)."""
    generator = torch.Generator(device="cuda").manual_seed(rows)
    for layer, width, swiglu in ((_fp8_layer(27392, 4096, dtype, True, generator), 4096, False),
                                 (_fp8_layer(4096, 13696, dtype, False, generator), 2 * 13696, True)):
        inputs = torch.randn(rows, width, device="cuda", generator=generator).to(dtype)
        if swiglu:
            up, gate = inputs.float().chunk(2, dim=-1)
            products = (torch.nn.functional.silu(gate) * up).to(dtype)
        else:
            products = inputs
        expected = fp8_linear(products, layer.stored, layer.scale, layer.input_scale, layer.bias)
        got = layer(inputs, swiglu=swiglu)
        assert got.dtype == dtype and got.shape == expected.shape
        # both sum in float32 (in other orders: ~1e-4 of the largest output over 13,696 products); bfloat16 output
        # rounds to 8 bits, and the bias is added after that rounding: 1.5 units of 2^-7 at most
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-4
        assert torch.allclose(got.float(), expected.float(), rtol=ulp, atol=ulp * float(expected.abs().max())), swiglu


@FP8_GPU
@pytest.mark.parametrize("kv", [False, True], ids=["kv16", "kv8"])
def test_fast_model_on_the_gpu_computes_the_references_function_cuda(fp8_checkpoint, odd_kv_scale, kv):
    """float32 compute: the FP8 matmuls, the FP8 KV cache's Triton kernels and the CUDA graphs (decode, one-prompt
    prefill, mixed steps) against the dequantized reference; every matmul sums in another order here, so fewer rows
    agree to float32's tolerance on the GPU (1e-3 of the largest logit, as the float runtime's GPU tests take)."""
    path = odd_kv_scale if kv else fp8_checkpoint(kv=False)
    gpu = load_fast_model(path, device="cuda", dtype="float32", **SMALL)
    assert gpu._graphs and gpu._prefill_graphs and gpu._mixed_graphs
    check_passes(gpu, load_model(path, dtype="float32"), agreement=0.0, atol=1e-3 * 20)


@FP8_GPU
def test_fast_runtime_serves_the_fixtures_chats_exactly_cuda(fp8_checkpoint, chats):
    tokenizer, prompts, answers = chats
    model = load_fast_model(fp8_checkpoint(), device="cuda", num_slots=8, max_seq_len=256, block_size=16)
    wrong = wrong_answers(tokenizer, serve(model, prompts, tokenizer, longest(tokenizer, answers), "cuda"), answers)
    assert not wrong, f"{len(wrong)}/{len(answers)} wrong, e.g. {wrong[0]}"


@CUDA
def test_gpus_without_fp8_refuse_fp8_checkpoints_cuda(fp8_checkpoint):
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has FP8 tensor cores")
    with pytest.raises(UsageError, match="has no FP8 tensor cores"):
        load_fast_model(fp8_checkpoint(), device="cuda", **SMALL)


def test_verify_points_fp8_checkpoints_to_bench_fp8(fp8_checkpoint, fixture_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["verify", "--checkpoint", str(fp8_checkpoint()), "--hf-model", str(fixture_dir)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == UsageError.exit_code and "is an FP8 checkpoint" in last and "bench fp8" in last
