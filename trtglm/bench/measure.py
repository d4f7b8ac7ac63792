"""`bench runtime`'s measurements: random 6B-shaped weights in both forms, timing helpers, Hugging Face
`generate()` as the baseline, and the fast runtime's timings (decode, long prompt, profile, in-flight run)."""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

from trtglm.conventions import QUANT_ALGOS
from trtglm.errors import DependencyError

log = logging.getLogger(__name__)

MODES = {"none": None, **QUANT_ALGOS}  # weight-only mode -> quant_algo
WEIGHT_ONLY = tuple(MODES)
KIND_OF_MODE = {"none": 0, "int8": 1, "int4": 2}  # kernels.FLOAT / INT8 / INT4
QUANTIZED_HF = ("self_attention.query_key_value.weight", "self_attention.dense.weight", "mlp.dense_h_to_4h.weight",
                "mlp.dense_4h_to_h.weight")  # HF weights that weight-only quantization applies to
DTYPES_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}
COPY_BYTES = 4 << 30


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


# --- weights -----------------------------------------------------------------------------------------------------

def synth_tensors(preset: str, layers: int | None, dtype: str, seed: int, device: torch.device):
    """(ChatGLMConfig, HF tensors) of a random-weight preset, generated on the GPU (synth's distribution)."""
    from trtglm.chatglm.config import ChatGLMConfig
    from trtglm.convert.writer import DTYPES as TORCH_DTYPES
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
        values = torch.randn(shape, device=device, dtype=TORCH_DTYPES[dtype], generator=generator)
        tensors[name] = values.mul_(NORM_STD).add_(1.0) if name.endswith("layernorm.weight") else \
            values.mul_(WEIGHT_STD)
    log.info("synthesized %s (%d layers) on %s: %.2f GB", preset, cfg.num_layers, device,
             sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9)
    return cfg, tensors


def checkpoint_tensors(cfg, hf_tensors: dict[str, torch.Tensor], dtype: str, tp_size: int = 1, rank: int = 0):
    """(CheckpointConfig, rank tensors) exactly as `convert` would write rank `rank` of a tp-`tp_size` checkpoint."""
    from trtglm.convert.writer import plan_conversion, trtllm_config
    from trtglm.runtime.checkpoint import CheckpointConfig

    ckpt_cfg = CheckpointConfig.from_dict(trtllm_config(cfg, dtype, tp_size, 1, None))
    tensors = {p.trt: _rank_tensor(p.ranks[rank], hf_tensors[p.hf]) for p in plan_conversion(cfg, tp_size)}
    return ckpt_cfg, tensors


def random_checkpoint(preset: str, device: torch.device):
    """(CheckpointConfig, rank-0 tensors) of a random-weight bf16 preset on `device`, as `convert` would write it."""
    cfg, hf_tensors = synth_tensors(preset, None, "bfloat16", 0, device)
    return checkpoint_tensors(cfg, hf_tensors, "bfloat16")


def run_kinds(kinds: str, out: str | None, bench_kind) -> None:
    """Measure weight kinds one by one (`kinds`: weight-only modes, comma-separated): `bench_kind(mode, checkpoint
    config, tensors, generator)` gets the random 6B checkpoint and returns that kind's results; `out`: JSON file."""
    device = cuda_device()
    ckpt_cfg, tensors = random_checkpoint("6b", device)
    generator = torch.Generator(device=device).manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "kinds": {}}
    for mode in kinds.split(","):
        results["kinds"][mode] = bench_kind(mode, ckpt_cfg, tensors, generator)
        gc.collect()
        torch.cuda.empty_cache()
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


def _rank_tensor(selection, tensor: torch.Tensor) -> torch.Tensor:
    """The rank's tensor; the source itself (no copy) when the selection keeps every row in order."""
    rows, full_width = selection.rows, selection.cols in (None, (0, tensor.shape[-1]))
    in_order = rows[0][0] == 0 and rows[-1][1] == tensor.shape[0] and all(a[1] == b[0] for a, b in pairwise(rows))
    return tensor if full_width and in_order else selection.apply(tensor).contiguous()


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


def inflight_stats(requests: int, concurrency: int, lengths: list[int], outputs: list[int],
                    submitted: dict[int, float], token_times: dict[int, list[float]], elapsed: float) -> dict:
    ttft = [(times[0] - submitted[i]) * 1e3 for i, times in token_times.items() if times]
    itl = [(b - a) * 1e3 for times in token_times.values() for a, b in pairwise(times)]
    generated = sum(len(t) for t in token_times.values())
    return {"requests": requests, "concurrency": concurrency, "prompt_tokens": sum(lengths),
            "generated_tokens": generated, "expected_tokens": sum(outputs), "seconds": elapsed,
            "requests_per_s": requests / elapsed, "tokens_per_s": generated / elapsed,
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)}}


def percentile(values: list[float], q: float) -> float | None:
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

    device = cuda_device()
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

def cuda_device(bench: str = "runtime") -> torch.device:
    """The GPU that `trtglm bench BENCH` measures on; DependencyError naming that bench without one or Triton."""
    if not torch.cuda.is_available():
        raise DependencyError(f"bench {bench} needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise DependencyError(f"bench {bench} needs Triton (pip install triton)") from None
    return torch.device("cuda", torch.cuda.current_device())
