"""`trtglm bench runtime`: trtglm's fast GPU runtime against Hugging Face `generate()` and the bandwidth floor.

One process, one GPU, one set of random weights (a `synth` preset, generated on the GPU):

1. The HF ChatGLM tensors are cut into a tp-1 TensorRT-LLM checkpoint by `convert`'s own
   plan and split rules (no disk: 12 GB would cost more than the benchmark), and the same
   tensors build transformers' `GlmForCausalLM` (the reference, eager, as the seed
   deployments serve ChatGLM).
2. Correctness: each fused kernel against its torch definition at the model's shapes;
   int8/int4 matmuls against float32 products with the dequantized weights; the whole
   fast model (prefill, CUDA-graph decode, `score`) against `GlmForCausalLM`'s logits on
   random token sequences: top-1 agreement and max |Δlogit|, and for weight-only modes the
   loss against the unquantized reference.
3. Speed per batch size, prompt length and generated length (forced: EOS is ignored):
   time to first token, ms per decode step (CUDA events over the greedy loop, tokens
   never leave the GPU), generated tokens/s; the same for HF `generate()`; the floor of a
   decode step, (weights read + KV cache read) / the device-to-device copy bandwidth
   measured here (bytes read + written, as a copy of the weight bytes would move them).
4. Time to first token for one long prompt; a torch.profiler table of one eager decode
   step (the kernels a graph replays); an in-flight batching run through the executor
   (trtglm.runtime.executor) with mixed prompt and output lengths at a fixed concurrency.

Results: `runtime.json` and `runtime.png` (generated tokens/s against batch size, both
systems, and the floor) in the output folder, and a table on stdout.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

import torch

from trtglm.errors import DependencyError, TrtglmError, UsageError

log = logging.getLogger(__name__)

WEIGHT_ONLY = ("none", "int8", "int4")
KIND_OF_MODE = {"none": 0, "int8": 1, "int4": 2}  # kernels.FLOAT / INT8 / INT4
MODES = {"none": None, "int8": "W8A16", "int4": "W4A16"}  # quant_algo
QUANTIZED_HF = ("self_attention.query_key_value.weight", "self_attention.dense.weight", "mlp.dense_h_to_4h.weight",
                "mlp.dense_4h_to_h.weight")  # HF weights that weight-only quantization applies to
DTYPES_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny-chatglm3"  # a trained tiny ChatGLM3
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}
CHECK_SEQUENCES = 4
COPY_BYTES = 4 << 30
INFLIGHT_PROMPTS = (32, 1024)  # prompt tokens, inclusive
INFLIGHT_OUTPUTS = (16, 256)  # generated tokens, inclusive
# The runtime's targets. Millisecond limits are an H200's; on another GPU they are the same fractions of the floor,
# i.e. scaled by the H200's copy bandwidth (docs/benchmarks.md: 4,286 GB/s) over the one measured in the run.
H200_COPY_GBS = 4286.0
DECODE_MS_TARGETS = {"int8": 2.2, "int4": 1.4}  # batch-1 decode step on an H200
FLOOR_RATIO_TARGET = 1.25  # the dtype's batch-1 decode step over its floor, at most
SPEEDUP_TARGET = (64, 10.0)  # at this batch, tokens/s over HF's, at least
LONG_TTFT_TARGET_MS = 30.0  # one long prompt (--long-prompt), at most
KERNEL_TOLERANCE = 1e-2  # relative error: bf16 rounding gives ~1e-3; a wrong kernel gives ~1


@dataclass
class BatchTiming:
    system: str  # "trtglm none|int8|int4" or "hf"
    batch: int
    ttft_ms: float
    decode_ms: float  # per step
    tokens_per_s: float  # generated tokens / (TTFT + all decode steps)
    floor_ms: float | None = None
    pct_of_floor: float | None = None  # floor / decode step × 100
    speedup_vs_hf: float | None = None  # tokens/s over HF's at the same batch


def bench_runtime(preset: str = "6b", dtype: str = "bf16", weight_only: Sequence[str] | str = "none",
                  batch: Sequence[int] | int = (1, 8, 32, 64), prompt_len: int = 128, new_tokens: int = 128,
                  baseline: str = "hf", out: str | Path = "out/bench-runtime", layers: int | None = None,
                  long_prompt: int = 512, requests: int = 256, concurrency: int = 64, prefill_chunk: int = 1024,
                  check: bool = True, profile: bool = True, tune: bool | None = None, seed: int = 0) -> dict:
    """Run the benchmark (see the module docstring); returns the results written to OUT/runtime.json."""
    modes, batches = _as_list(weight_only, str), _as_list(batch, int)
    dtype_name = _check_options(preset, dtype, modes, batches, prompt_len, new_tokens, baseline, requests,
                                concurrency, prefill_chunk)
    device = _cuda_device()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    results: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": _device_info(),
                     "options": {"preset": preset, "dtype": dtype_name, "weight_only": modes, "batch": batches,
                                 "prompt_len": prompt_len, "new_tokens": new_tokens, "baseline": baseline,
                                 "layers": layers, "long_prompt": long_prompt, "requests": requests,
                                 "concurrency": concurrency, "prefill_chunk": prefill_chunk, "tune": tune,
                                 "seed": seed}}
    stage = _Stages(results, out / "runtime.json")
    cfg, hf_tensors = synth_tensors(preset, layers, dtype_name, seed, device)
    ckpt_cfg, trt_tensors = checkpoint_tensors(cfg, hf_tensors, dtype_name)
    results["model"] = {"layers": cfg.num_layers, "parameters": sum(t.numel() for t in hf_tensors.values())}
    results["copy_bandwidth_gbs"] = copy_bandwidth(device) / 1e9
    reference = hf_reference(cfg, hf_tensors, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    check_ids = torch.randint(0, cfg.vocab_size, (CHECK_SEQUENCES, prompt_len + new_tokens), device=device,
                              generator=generator)
    references: dict[str, torch.Tensor] = {}
    if check:
        references = {"hf": _reference_logits(reference, check_ids),
                      "fp32": float32_reference_logits(cfg, hf_tensors, device, check_ids)}
        results["hf_bf16_vs_fp32"] = compare_logits(references["hf"], references["fp32"])
    results["hf"] = []
    if baseline == "hf":
        stage("hf", lambda: [asdict(t) for t in hf_timings(reference, batches, prompt_len, new_tokens, generator)])
    if check:
        compute = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16
        stage("kernel_checks", lambda: kernel_checks(ckpt_cfg, device, compute))
        stage("fixture_check", lambda: fixture_check(device, dtype_name, prompt_len, new_tokens, generator))
    results["trtglm"] = {}
    max_seq_len = _round_up(max(prompt_len + new_tokens, long_prompt + 1, INFLIGHT_PROMPTS[1] + INFLIGHT_OUTPUTS[1]),
                            256)
    weights = Weights(cfg, hf_tensors, ckpt_cfg, trt_tensors)
    for mode in modes:
        stage(f"trtglm.{mode}", lambda mode=mode: _bench_mode(
            mode, weights, results["options"], max_seq_len, check_ids, references, results["copy_bandwidth_gbs"] * 1e9,
            generator, profile=profile, inflight=mode == modes[0] and requests > 0))
    _fill_ratios(results)
    results["targets"] = targets(results)
    stage.save()
    print(summary(results))
    plot(results, out / "runtime.png")
    if results["errors"]:
        raise BenchmarkError(f"{len(results['errors'])} part(s) failed: {', '.join(results['errors'])}")
    return results


class BenchmarkError(TrtglmError):
    """A part of the benchmark failed (the others ran; see runtime.json's `errors`)."""


class _Stages:
    """Runs the benchmark's parts: each result lands in `results` (dotted key) and on disk at once; a part
    that fails is logged and recorded under `errors`, and the next part runs."""

    def __init__(self, results: dict, path: Path):
        self.results, self.path = results, path
        results["errors"] = {}

    def __call__(self, key: str, fn: Callable[[], object]) -> None:
        *parents, leaf = key.split(".")
        target = self.results
        for part in parents:
            target = target.setdefault(part, {})
        try:
            target[leaf] = fn()
        except Exception as e:  # a benchmark part on a lent GPU: keep the other parts' numbers
            log.exception("%s failed", key)
            self.results["errors"][key] = f"{type(e).__name__}: {e}"
            gc.collect()
            torch.cuda.empty_cache()
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=2) + "\n", encoding="utf-8")


# --- weights -----------------------------------------------------------------------------------------------------

def synth_tensors(preset: str, layers: int | None, dtype: str, seed: int, device: torch.device):
    """(ChatGLMConfig, HF tensors) of a random-weight preset, generated on the GPU (synth's distribution)."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.convert.synth import DTYPES as SYNTH_DTYPES
    from trtglm.convert.synth import (
        INV_FREQ,
        NORM_STD,
        WEIGHT_STD,
        preset_config,
        tensor_specs,
    )

    cfg = ChatGLMConfig.from_hf_dict(preset_config(preset, layers, dtype), "chatglm3")
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in tensor_specs(cfg):
        if name == INV_FREQ:
            continue
        values = torch.randn(shape, device=device, dtype=SYNTH_DTYPES[dtype], generator=generator)
        tensors[name] = values.mul_(NORM_STD).add_(1.0) if name.endswith("layernorm.weight") else \
            values.mul_(WEIGHT_STD)
    log.info("synthesized %s (%d layers) on %s: %.2f GB", preset, cfg.num_layers, device,
             sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9)
    return cfg, tensors


def checkpoint_tensors(cfg, hf_tensors: dict[str, torch.Tensor], dtype: str):
    """(CheckpointConfig, rank-0 tensors) exactly as `convert` would write a tp-1 checkpoint."""
    from trtglm.convert.writer import plan_conversion, trtllm_config
    from trtglm.runtime.checkpoint import CheckpointConfig

    ckpt_cfg = CheckpointConfig.from_dict(trtllm_config(cfg, dtype, 1, 1, None))
    tensors = {p.trt: _rank_tensor(p.ranks[0], hf_tensors[p.hf]) for p in plan_conversion(cfg, 1)}
    return ckpt_cfg, tensors


def random_checkpoint(preset: str, device: torch.device):
    """(CheckpointConfig, rank-0 tensors) of a random-weight bf16 preset on `device`, as `convert` would write it."""
    cfg, hf_tensors = synth_tensors(preset, None, "bfloat16", 0, device)
    return checkpoint_tensors(cfg, hf_tensors, "bfloat16")


def run_kinds(description: str, default_kinds: str, bench_kind) -> None:
    """The command line of a GPU script that measures weight kinds one by one: `--kinds` (weight-only modes) and
    `--out` (JSON); `bench_kind(mode, checkpoint config, tensors, generator)` gets the random 6B checkpoint and
    returns that kind's results."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kinds", default=default_kinds)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    ckpt_cfg, tensors = random_checkpoint("6b", device)
    generator = torch.Generator(device=device).manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "kinds": {}}
    for mode in args.kinds.split(","):
        results["kinds"][mode] = bench_kind(mode, ckpt_cfg, tensors, generator)
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _rank_tensor(selection, tensor: torch.Tensor) -> torch.Tensor:
    """The rank's tensor; the source itself (no copy) when the selection keeps every row in order."""
    rows, full_width = selection.rows, selection.cols in (None, (0, tensor.shape[-1]))
    in_order = rows[0][0] == 0 and rows[-1][1] == tensor.shape[0] and all(a[1] == b[0] for a, b in pairwise(rows))
    return tensor if full_width and in_order else selection.apply(tensor).contiguous()


def hf_reference(cfg, hf_tensors: dict[str, torch.Tensor], device: torch.device):
    """`GlmForCausalLM` over the same tensors (no copies), rotary frequencies in float32 as HF keeps them."""
    from trtglm.chatglm.reference import load_reference

    dtype = next(iter(hf_tensors.values())).dtype
    model = load_reference(cfg, hf_tensors.__getitem__, dtype)
    model.model.rotary_emb.__init__(model.config)
    return model.to(device)


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def float32_reference_logits(cfg, hf_tensors: dict[str, torch.Tensor], device: torch.device, ids: torch.Tensor
                             ) -> torch.Tensor:
    """Logits of `GlmForCausalLM` in float32 on the same weights: how far bf16 itself lands from exact."""
    model = hf_reference(cfg, {name: t.float() for name, t in hf_tensors.items()}, device)
    logits = _reference_logits(model, ids)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return logits


# --- timing helpers ----------------------------------------------------------------------------------------------

def wall_ms(fn: Callable[[], object]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(wall_ms(fn) for _ in range(repeats))


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


# --- Hugging Face baseline ---------------------------------------------------------------------------------------

def hf_timings(model, batches: list[int], prompt_len: int, new_tokens: int, generator: torch.Generator
               ) -> list[BatchTiming]:
    rows = []
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=generator.device,
                            generator=generator)

        def generate(n: int, ids: torch.Tensor = ids) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)

        generate(2)  # warm-up
        ttft = median_ms(lambda: generate(1), 3)
        total = wall_ms(lambda: _expect_length(generate(new_tokens), prompt_len + new_tokens))
        decode = (total - ttft) / max(1, new_tokens - 1)
        rows.append(BatchTiming("hf", batch, ttft, decode, batch * new_tokens / total * 1e3))
        log.info("hf batch %d: TTFT %.1f ms, %.2f ms/step", batch, ttft, decode)
    return rows


def _expect_length(output: torch.Tensor, length: int) -> None:
    if output.shape[1] != length:
        raise RuntimeError(f"generate() returned {output.shape[1]} positions, expected {length}")


# --- correctness -------------------------------------------------------------------------------------------------

def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Top-1 agreement, max |Δ|, relative error; and agreement where the reference's top-2 gap exceeds max |Δ|."""
    diff = (ours - ref).abs()
    max_diff = float(diff.max())
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > max_diff
    agree = ours.argmax(-1) == ref.argmax(-1)
    return {"top1": float(agree.float().mean()), "max_abs_diff": max_diff,
            "rel_error": float((ours - ref).norm() / ref.norm()), "ref_max_abs": float(ref.abs().max()),
            "decisive_share": float(decisive.float().mean()),
            "top1_decisive": float(agree[decisive].float().mean()) if decisive.any() else None}


def check_model(model, ids: torch.Tensor, references: dict[str, torch.Tensor], prompt_len: int) -> dict:
    """Prefill + CUDA-graph decode (teacher-forced), and `score`, against each reference's logits.

    Keys `{path}_vs_{reference}`: path `decode` (prefill of `prompt_len` tokens, then one decode step
    per later token) or `score` (every position of the sequence in one prefill).
    """
    slots = list(range(ids.shape[0]))
    rows = [model.prefill(slots, ids[:, :prompt_len].tolist())]
    for position in range(prompt_len, ids.shape[1] - 1):
        rows.append(model.decode(slots, ids[:, position]))
    for slot in slots:
        model.release(slot)
    decoded = torch.stack(rows, dim=1)  # logits of positions prompt_len-1 .. T-2
    scored = torch.stack([model.score(seq) for seq in ids.tolist()])
    out = {}
    for name, ref in references.items():
        out[f"decode_vs_{name}"] = compare_logits(decoded, ref[:, prompt_len - 1:-1])
        out[f"score_vs_{name}"] = compare_logits(scored, ref)
    return out


def quantized_reference_logits(cfg, hf_tensors: dict[str, torch.Tensor], algo: str, device: torch.device,
                               ids: torch.Tensor) -> torch.Tensor:
    """`GlmForCausalLM` with the weights weight-only quantization stands for (ŵ = q × scale per row, rounded
    to the dtype): what the quantized fast model should compute."""
    from trtglm.runtime.quant import fake_quantize

    tensors = {name: fake_quantize(t, algo).to(t.dtype) if name.endswith(QUANTIZED_HF) else t
               for name, t in hf_tensors.items()}
    model = hf_reference(cfg, tensors, device)
    logits = _reference_logits(model, ids)
    del model, tensors
    gc.collect()
    torch.cuda.empty_cache()
    return logits


def fixture_check(device: torch.device, dtype: str, prompt_len: int, new_tokens: int,
                  generator: torch.Generator) -> dict | None:
    """The trained tiny fixture (decisive logits, unlike random weights) run by the fast model against
    `GlmForCausalLM` in the same dtype and in float32, on random token sequences; per weight-only mode."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.chatglm.weights import HFWeights
    from trtglm.runtime.fast import FastModel

    if not (FIXTURE / "config.json").is_file():
        return None
    cfg, weights = ChatGLMConfig.from_model_dir(FIXTURE), HFWeights(FIXTURE)
    hf_tensors = {name: weights.get(name).to(device=device, dtype=DTYPES_TORCH[dtype]) for name in weights.names()
                  if not name.endswith("inv_freq")}
    ckpt_cfg, tensors = checkpoint_tensors(cfg, hf_tensors, dtype)
    length = min(prompt_len + new_tokens, cfg.seq_length)
    ids = torch.randint(0, cfg.vocab_size, (CHECK_SEQUENCES, length), device=device, generator=generator)
    references = {"hf": _reference_logits(hf_reference(cfg, hf_tensors, device), ids),
                  "fp32": float32_reference_logits(cfg, hf_tensors, device, ids)}
    out = {"hf_vs_fp32": compare_logits(references["hf"], references["fp32"])}
    for mode in WEIGHT_ONLY:
        model = FastModel(ckpt_cfg, tensors, max_batch=CHECK_SEQUENCES, max_seq_len=length, weight_only=mode,
                          device=device)
        refs = references if mode == "none" else \
            {**references, "quantized": quantized_reference_logits(cfg, hf_tensors, MODES[mode], device, ids)}
        out[mode] = check_model(model, ids, refs, min(prompt_len, length // 2))
    return out


def kernel_checks(cfg, device: torch.device, dtype: torch.dtype) -> dict:
    """Relative error of each Triton kernel against its torch definition, at the model's shapes."""
    from trtglm.runtime.fast.ops import TorchOps, TritonOps

    fast, ref, g = TritonOps(), TorchOps(), torch.Generator(device=device).manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device=device, generator=g) * scale).to(dtype)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    h, heads, kv, d, inner = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    out: dict[str, float] = {}
    x, delta, w = rnd(64, h), rnd(64, h), rnd(h)
    out["add_rms_norm"] = max(rel(a, b) for a, b in zip(fast.add_rms_norm(x, delta, w, 1e-5),
                                                         ref.add_rms_norm(x, delta, w, 1e-5)))
    length, slots_n = 1280, 9
    cos, sin = _tables(cfg, length, device)
    caches = [rnd(slots_n, kv, length, d) for _ in range(2)]
    copies = [c.clone() for c in caches]
    qkv = rnd(64, (heads + 2 * kv) * d)
    slots = torch.randint(0, slots_n, (64,), device=device, generator=g)
    positions = torch.randperm(length, device=device, generator=g)[:64].to(torch.int32)
    q_fast = fast.rope_cache(qkv, slots, positions, cos, sin, caches[0], caches[1], heads)
    q_ref = ref.rope_cache(qkv, slots, positions, cos, sin, copies[0], copies[1], heads)
    out["rope_cache"] = max(rel(q_fast, q_ref), rel(caches[0], copies[0]), rel(caches[1], copies[1]))
    q = rnd(8, heads, d)
    slots8 = torch.randperm(slots_n, device=device, generator=g)[:8]
    positions8 = torch.randint(0, length, (8,), device=device, generator=g, dtype=torch.int32)
    out["decode_attention"] = rel(fast.decode_attention(q, caches[0], caches[1], slots8, positions8),
                                  ref.decode_attention(q, caches[0], caches[1], slots8, positions8))
    for position in (100, 1000):  # one sequence (rope_attention): one chunk of positions, and four merged
        one = slots8[:1], torch.tensor([position], dtype=torch.int32, device=device)
        attended = fast.decode_qkv_attention(qkv[:1], *one, cos, sin, caches[0], caches[1], heads)
        out[f"decode_qkv_attention_{position}"] = max(
            rel(attended, ref.decode_qkv_attention(qkv[:1], *one, cos, sin, copies[0], copies[1], heads)),
            rel(caches[0], copies[0]), rel(caches[1], copies[1]))
    y = rnd(64, 2 * inner)
    out["silu_mul"] = rel(fast.silu_mul(y), ref.silu_mul(y))
    out.update(matmul_checks(cfg, rnd, rel))
    bad = {k: v for k, v in out.items() if not v < KERNEL_TOLERANCE}
    if bad:
        log.error("kernels off their torch definitions: %s", bad)
    return out


def matmul_checks(cfg, rnd: Callable[..., torch.Tensor], rel: Callable[..., float]) -> dict[str, float]:
    """Each weight kind × kernel (one-row, tensor-core, cuBLAS) against float32 products with Ŵ."""
    from trtglm.runtime.fast import kernels
    from trtglm.runtime.fast.linear import Linear
    from trtglm.runtime.quant import fake_quantize

    h, inner, qkv_rows = cfg.hidden_size, cfg.intermediate_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_size
    out = {}
    for mode, algo in (("bf16", None), ("int8", "W8A16"), ("int4", "W4A16")):
        for name, (rows, cols), bias, swiglu in (("fc", (2 * inner, h), False, False),
                                                 ("qkv", (qkv_rows, h), True, False),
                                                 ("proj_swiglu", (h, inner), False, True)):
            weight, b = rnd(rows, cols, scale=0.02), rnd(rows, scale=0.02) if bias else None
            layer = Linear.from_weight(weight, b, algo, weight.dtype, use_triton=True)
            exact = fake_quantize(weight, algo) if algo else weight.float()
            for m in (1, 16, 64, 512):
                x = rnd(m, 2 * cols if swiglu else cols)
                inputs = kernels.silu_mul(x) if swiglu else x
                expected = inputs.float() @ exact.T + (b.float() if bias else 0)
                configs = {"": kernels.CANDIDATES[1][0], "_cublas": kernels.CUBLAS} if not algo and m == 1 else \
                    {"": None, "_cublas": kernels.CUBLAS} if algo and m == 512 else {"": None}
                for suffix, config in configs.items():
                    got = kernels.matmul(x, layer.stored, layer.scale, layer.bias, layer.kind, swiglu, config)
                    out[f"{mode}_{name}_m{m}{suffix}"] = rel(got, expected)
    return out


def _tables(cfg, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from trtglm.runtime.model import rotary_tables

    cos, sin = rotary_tables(cfg, torch.arange(length, device=device)[None])
    return cos[0, 0].contiguous(), sin[0, 0].contiguous()


# --- the fast runtime --------------------------------------------------------------------------------------------

@dataclass
class Weights:
    """One set of random weights in both forms: HF ChatGLM tensors and the tp-1 checkpoint's."""

    hf_cfg: object  # ChatGLMConfig
    hf_tensors: dict[str, torch.Tensor]
    ckpt_cfg: object  # CheckpointConfig
    tensors: dict[str, torch.Tensor]


def _bench_mode(mode: str, weights: Weights, opts: dict, max_seq_len: int, check_ids: torch.Tensor,
                references: dict[str, torch.Tensor], bandwidth: float, generator: torch.Generator, profile: bool,
                inflight: bool) -> dict:
    from trtglm.runtime.fast import FastModel

    batches, prompt_len, new_tokens = opts["batch"], opts["prompt_len"], opts["new_tokens"]
    start = time.perf_counter()
    model = FastModel(weights.ckpt_cfg, weights.tensors, max_batch=max(max(batches), opts["concurrency"]),
                      max_seq_len=max_seq_len, weight_only=mode, tune=opts["tune"])
    entry: dict = {"weight_gb": model.weight_bytes / 1e9, "setup_s": time.perf_counter() - start}
    if references:
        if mode != "none":
            references = {**references, "quantized": quantized_reference_logits(
                weights.hf_cfg, weights.hf_tensors, MODES[mode], model.device, check_ids)}
        entry["check"] = check_model(model, check_ids, references, prompt_len)
    entry["runs"] = []
    for batch in batches:
        timing = fast_timing(model, batch, prompt_len, new_tokens, generator)
        timing.system = f"trtglm {mode}"
        timing.floor_ms = decode_floor_ms(model, batch, prompt_len + new_tokens // 2, bandwidth)
        entry["runs"].append(asdict(timing))
        log.info("trtglm %s batch %d: TTFT %.1f ms, %.3f ms/step (floor %.3f)", mode, batch, timing.ttft_ms,
                 timing.decode_ms, timing.floor_ms)
    entry["ttft_long_ms"] = {"prompt_len": opts["long_prompt"],
                             "ms": long_ttft_ms(model, opts["long_prompt"], generator)}
    if profile:
        entry["profile"] = {str(b): profile_decode_step(model, b) for b in sorted({1, max(batches)})}
    if inflight:
        entry["inflight"] = inflight_run(model, opts["requests"], opts["concurrency"], generator,
                                         prefill_tokens=opts["prefill_chunk"])
    if model.tuned:
        from trtglm.runtime.fast.kernels import CHOSEN

        entry["matmul_configs"] = {str(k): v for k, v in CHOSEN.items() if k[0] == KIND_OF_MODE[mode]}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return entry


def fast_timing(model, batch: int, prompt_len: int, new_tokens: int, generator: torch.Generator) -> BatchTiming:
    slots = list(range(batch))
    prompts = torch.randint(0, model.vocab_size, (batch, prompt_len), device=generator.device,
                            generator=generator).tolist()
    model.prefill(slots, prompts)  # warm-up
    ttft = median_ms(lambda: model.prefill(slots, prompts), 3)
    tokens = model.prefill(slots, prompts).argmax(-1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(new_tokens - 1):
        tokens = model.decode(slots, tokens).argmax(-1)
    end.record()
    end.synchronize()
    for slot in slots:
        model.release(slot)
    decode = start.elapsed_time(end) / max(1, new_tokens - 1)
    total = ttft + decode * (new_tokens - 1)
    return BatchTiming("trtglm", batch, ttft, decode, batch * new_tokens / total * 1e3)


def decode_floor_ms(model, batch: int, context: int, bandwidth: float) -> float:
    """Weights read once plus the KV cache of `batch` sequences of `context` tokens, at copy bandwidth."""
    cfg = model.config
    kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * model.dtype.itemsize
    return (model.weight_bytes + kv_bytes) / bandwidth * 1e3


def long_ttft_ms(model, prompt_len: int, generator: torch.Generator, repeats: int = 5) -> float:
    prompt = torch.randint(0, model.vocab_size, (prompt_len,), device=generator.device, generator=generator).tolist()
    model.prefill([0], [prompt])
    ms = median_ms(lambda: model.prefill([0], [prompt]), repeats)
    model.release(0)
    return ms


def profile_decode_step(model, batch: int, top: int = 12) -> dict:
    """The kernels of one eager decode step of `batch` sequences (what the graph replays), by GPU time. Launched
    without programmatic dependent launch, so that a kernel's time is its own, not partly spent waiting for the
    kernel before."""
    from torch.profiler import ProfilerActivity, profile

    from trtglm.runtime.fast import kernels

    slots = list(range(batch))
    tokens = model.prefill(slots, [[1, 2, 3]] * batch).argmax(-1)
    pdl, kernels.PDL_ENABLED = kernels.PDL_ENABLED, False
    try:
        tokens = model.decode(slots, tokens, use_graph=False).argmax(-1)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.decode(slots, tokens, use_graph=False)
            torch.cuda.synchronize()
    finally:
        kernels.PDL_ENABLED = pdl
    for slot in slots:
        model.release(slot)
    events = [e for e in prof.key_averages() if _device_us(e) > 0]
    events.sort(key=_device_us, reverse=True)
    total = sum(_device_us(e) for e in events)
    return {"kernels": sum(e.count for e in events), "kernel_ms": total / 1e3,
            "top": [{"name": e.key[:90], "calls": e.count, "ms": _device_us(e) / 1e3} for e in events[:top]]}


def _device_us(event) -> float:
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0)


def inflight_run(model, requests: int, concurrency: int, generator: torch.Generator, prefill_tokens: int = 512,
                 prompt_range: tuple[int, int] = INFLIGHT_PROMPTS, output_range: tuple[int, int] = INFLIGHT_OUTPUTS
                 ) -> dict:
    """Closed loop through the executor: `concurrency` requests in flight, a new one as each finishes.

    Prompt and output lengths are uniform over the given inclusive ranges; EOS is never set. The executor
    prefills at most `prefill_tokens` prompt tokens per step (longer prompts in chunks between decode steps).
    """
    from trtglm.runtime.executor import Executor, Request

    def uniform(low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (requests,), generator=generator, device=generator.device).tolist()

    lengths, outputs = uniform(*prompt_range), uniform(*output_range)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=generator, device=generator.device).tolist()
               for n in lengths]
    executor = Executor(model, max_queue=requests, max_prefill_tokens=prefill_tokens, device=model.device)
    submitted: dict[int, float] = {}
    token_times: dict[int, list[float]] = {i: [] for i in range(requests)}
    pending = iter(range(requests))

    def submit_next() -> None:
        i = next(pending, None)
        if i is None:
            return

        def on_output(output, i=i) -> None:
            now = time.perf_counter()
            token_times[i].extend([now] * len(output.tokens))
            if output.finished:
                submit_next()

        submitted[i] = time.perf_counter()
        executor.submit(Request(prompts[i], outputs[i]), on_output)

    start = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        submit_next()
    while executor.has_work():
        executor.step()
    elapsed = time.perf_counter() - start
    stats = _inflight_stats(requests, concurrency, lengths, outputs, submitted, token_times, elapsed)
    done = executor.stats()
    return {**stats, "prefill_tokens_per_step": prefill_tokens, "prefill_chunks": done.prefill_chunks,
            "decode_steps": done.decode_calls}


def _inflight_stats(requests: int, concurrency: int, lengths: list[int], outputs: list[int],
                    submitted: dict[int, float], token_times: dict[int, list[float]], elapsed: float) -> dict:
    ttft = [(times[0] - submitted[i]) * 1e3 for i, times in token_times.items() if times]
    itl = [(b - a) * 1e3 for times in token_times.values() for a, b in pairwise(times)]
    generated = sum(len(t) for t in token_times.values())
    return {"requests": requests, "concurrency": concurrency, "prompt_tokens": sum(lengths),
            "generated_tokens": generated, "expected_tokens": sum(outputs), "seconds": elapsed,
            "requests_per_s": requests / elapsed, "tokens_per_s": generated / elapsed,
            "ttft_ms": {"p50": _percentile(ttft, 50), "p99": _percentile(ttft, 99)},
            "itl_ms": {"p50": _percentile(itl, 50), "p99": _percentile(itl, 99)}}


def _percentile(values: list[float], q: float) -> float | None:
    """The value at rank q/100 · (n − 1) of the sorted values, rounded half up (no interpolation)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * (len(ordered) - 1) + 0.5))]


def gemv_probe(config: tuple = (0, 16, 512, 8, 3), word_config: tuple = (8, 2, 1, 4, True),
               pair_config: tuple = (4, 2, 1, 4)) -> None:
    """One launch of the one-row matmul per weight kind on the fc shape, for a profiler to look at
    (scripts/bench_gpu.sh runs it under Nsight Compute: compute- or memory-bound?)."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.convert.synth import preset_config
    from trtglm.convert.writer import trtllm_config
    from trtglm.runtime.checkpoint import CheckpointConfig
    from trtglm.runtime.fast import kernels
    from trtglm.runtime.fast.linear import Linear

    device = _cuda_device()
    cfg = CheckpointConfig.from_dict(trtllm_config(ChatGLMConfig.from_hf_dict(preset_config("6b"), "chatglm3"),
                                                   "bfloat16", 1, 1, None))
    weight = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    for algo in MODES.values():
        layer = Linear.from_weight(weight, None, algo, torch.bfloat16, use_triton=True)
        chosen = kernels.PairConfig(*pair_config) if algo == "W4A16" else \
            kernels.GemvConfig(*word_config) if algo else kernels.Config(*config)
        kernels.matmul(x, layer.stored, layer.scale, None, layer.kind, config=chosen)
        torch.cuda.synchronize()
        log.info("gemv probe: %s, %s", algo or "bf16", chosen)


# --- reporting ---------------------------------------------------------------------------------------------------

def _fill_ratios(results: dict) -> None:
    hf = {row["batch"]: row for row in results["hf"]}
    for entry in results["trtglm"].values():
        for row in entry["runs"]:
            row["pct_of_floor"] = 100 * row["floor_ms"] / row["decode_ms"]
            if row["batch"] in hf:
                row["speedup_vs_hf"] = row["tokens_per_s"] / hf[row["batch"]]["tokens_per_s"]


def targets(results: dict) -> list[dict]:
    """Each target the run has the figures for: its limit, this run's value and whether it is met."""
    runs = {(mode, row["batch"]): row for mode, entry in results["trtglm"].items() for row in entry["runs"]}
    h200 = "H200" in results["device"]["name"]
    scale = 1.0 if h200 else H200_COPY_GBS / results["copy_bandwidth_gbs"]
    rows = []

    def name(mode: str) -> str:
        return results["options"]["dtype"] if mode == "none" else mode

    def add(target: str, value: float | None, limit: float, unit: str, at_most: bool = True) -> None:
        if value is not None:
            rows.append({"target": target, "limit": limit, "at_most": at_most, "value": value, "unit": unit,
                         "met": value <= limit if at_most else value >= limit})

    if ("none", 1) in runs:
        row = runs["none", 1]
        add(f"{name('none')} batch 1 step / floor", row["decode_ms"] / row["floor_ms"], FLOOR_RATIO_TARGET, "×")
    batch, speedup = SPEEDUP_TARGET
    for mode in results["trtglm"]:
        if (mode, batch) in runs:
            add(f"{name(mode)} batch {batch} tokens/s over HF's", runs[mode, batch]["speedup_vs_hf"], speedup, "×",
                at_most=False)
    for mode, h200_ms in DECODE_MS_TARGETS.items():
        if (mode, 1) in runs:
            where = "" if h200 else f" (H200's {h200_ms} ms × {scale:.2f}, the bandwidth ratio)"
            add(f"{mode} batch 1 step{where}", runs[mode, 1]["decode_ms"], h200_ms * scale, "ms")
    for mode, entry in results["trtglm"].items():
        long = entry.get("ttft_long_ms")
        if long:
            add(f"{name(mode)} TTFT of a {long['prompt_len']}-token prompt", long["ms"], LONG_TTFT_TARGET_MS, "ms")
    return rows


def _target_line(t: dict) -> str:
    verdict = "met" if t["met"] else f"**missed by {abs(t['value'] / t['limit'] - 1):.1%}**"
    return (f"| {t['target']} | {'≤' if t['at_most'] else '≥'} {t['limit']:.3g} {t['unit']} | {t['value']:.3f} "
            f"{t['unit']} | {verdict} |")


def summary(results: dict) -> str:
    """Markdown tables of the results (printed, and pasted into docs/benchmarks.md)."""
    header = (f"device: {results['device']['name']}; copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s; "
              f"{results['model']['parameters'] / 1e9:.2f} B parameters, {results['model']['layers']} layers")
    lines = [header, "",
             "| system | batch | TTFT ms | ms/step | floor ms | % of floor | tokens/s | × HF |",
             "|---|---|---|---|---|---|---|---|"]
    rows = list(results["hf"]) + [row for entry in results["trtglm"].values() for row in entry["runs"]]
    for r in rows:
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] else "–"
        pct = f"{r['pct_of_floor']:.0f}%" if r["pct_of_floor"] else "–"
        speedup = f"{r['speedup_vs_hf']:.1f}" if r["speedup_vs_hf"] else "–"
        lines.append(f"| {r['system']} | {r['batch']} | {r['ttft_ms']:.1f} | {r['decode_ms']:.3f} | {floor} | {pct} "
                     f"| {r['tokens_per_s']:.0f} | {speedup} |")
    for mode, entry in results["trtglm"].items():
        lines.append("")
        lines.append(f"{mode}: {entry['weight_gb']:.2f} GB weights/step; TTFT {entry['ttft_long_ms']['prompt_len']} "
                     f"tokens {entry['ttft_long_ms']['ms']:.1f} ms")
        for name, check in entry.get("check", {}).items():
            lines.append(f"  {name}: {_check_line(check)}")
        for batch, p in entry.get("profile", {}).items():
            lines.append(f"  eager decode step, batch {batch}: {p['kernels']} kernels, {p['kernel_ms']:.3f} ms of "
                         "kernel time")
            lines.extend(f"    {t['ms']:.3f} ms  {t['calls']:4d}×  {t['name']}" for t in p["top"][:6])
        if "inflight" in entry:
            f = entry["inflight"]
            lines.append(f"  in-flight: {f['requests']} requests at concurrency {f['concurrency']}: "
                         f"{f['requests_per_s']:.2f} req/s, {f['tokens_per_s']:.0f} tokens/s, TTFT p50/p99 "
                         f"{f['ttft_ms']['p50']:.0f}/{f['ttft_ms']['p99']:.0f} ms, ITL p50/p99 "
                         f"{f['itl_ms']['p50']:.1f}/{f['itl_ms']['p99']:.1f} ms")
    if results.get("targets"):
        lines += ["", "| target | limit | this run | |", "|---|---|---|---|"]
        lines.extend(_target_line(t) for t in results["targets"])
    if "hf_bf16_vs_fp32" in results:
        lines.append(f"HF in the benchmark dtype vs HF fp32: {_check_line(results['hf_bf16_vs_fp32'])}")
    for mode, checks in (results.get("fixture_check") or {}).items():
        if mode == "hf_vs_fp32":
            lines.append(f"trained fixture, HF vs HF fp32: {_check_line(checks)}")
        else:
            lines.extend(f"trained fixture, {mode} {name}: {_check_line(c)}" for name, c in checks.items()
                         if name.startswith("decode"))
    if results.get("errors"):
        lines.append("")
        lines.extend(f"FAILED {key}: {error}" for key, error in results["errors"].items())
    if "kernel_checks" in results:
        lines.append("")
        lines.append("kernel checks (relative error): " + ", ".join(
            f"{k} {v:.1e}" for k, v in results["kernel_checks"].items()))
    return "\n".join(lines)


def _check_line(check: dict) -> str:
    decisive = "–" if check["top1_decisive"] is None else f"{check['top1_decisive']:.4f}"
    return (f"top-1 {check['top1']:.4f} (where decisive: {decisive} of {check['decisive_share']:.0%}), "
            f"max |Δ| {check['max_abs_diff']:.3f} of max |ref| {check['ref_max_abs']:.2f}, rel {check['rel_error']:.1e}")


def plot(results: dict, path: Path) -> None:
    """Generated tokens/s against batch size: each system, and the bf16 decode floor."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series = {"HF generate()": results["hf"]}
    series.update({f"trtglm {mode}": entry["runs"] for mode, entry in results["trtglm"].items()})
    for label, rows in series.items():
        if rows:
            ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=label)
    for mode, entry in results["trtglm"].items():
        rows = entry["runs"]
        ax.plot([r["batch"] for r in rows], [r["batch"] / r["floor_ms"] * 1e3 for r in rows], linestyle="--",
                linewidth=1, label=f"floor ({mode} weights)")
    opts = results["options"]
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="generated tokens/s",
           title=f"ChatGLM3-6B shapes, {opts['dtype']}, {opts['prompt_len']}+{opts['new_tokens']} tokens, "
                 f"{results['device']['name']}")
    ax.set_xticks(opts["batch"], [str(b) for b in opts["batch"]])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- options -----------------------------------------------------------------------------------------------------

def _as_list(value, kind: type) -> list:
    if isinstance(value, str):
        items = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    try:
        return [kind(v) for v in items]
    except (TypeError, ValueError):
        raise UsageError(f"expected a comma-separated list of {kind.__name__}, not {value!r}") from None


def _check_options(preset: str, dtype: str, modes: list[str], batches: list[int], prompt_len: int,
                   new_tokens: int, baseline: str, requests: int, concurrency: int, prefill_chunk: int) -> str:
    from trtglm.convert.synth import PRESETS

    if preset not in PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(PRESETS)}; not {preset!r}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be bf16 or fp16; not {dtype!r}")
    bad = [m for m in modes if m not in WEIGHT_ONLY]
    if bad or not modes:
        raise UsageError(f"--weight-only takes {', '.join(WEIGHT_ONLY)} (comma-separated); not {bad or modes}")
    if not batches or min(batches) < 1:
        raise UsageError(f"--batch needs positive batch sizes, not {batches}")
    if prompt_len < 1 or new_tokens < 2:
        raise UsageError("--prompt-len must be >= 1 and --new-tokens >= 2")
    if baseline not in ("hf", "none"):
        raise UsageError(f"--baseline must be hf or none; not {baseline!r}")
    if requests < 0 or concurrency < 1 or prefill_chunk < 1:
        raise UsageError("--requests must be >= 0, --concurrency and --prefill-chunk >= 1")
    return DTYPES[dtype]


def _cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        raise DependencyError("bench runtime needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise DependencyError("bench runtime needs Triton (pip install triton)") from None
    return torch.device("cuda", torch.cuda.current_device())


def _device_info() -> dict:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "memory_gb": props.total_memory / 1e9, "sms": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
