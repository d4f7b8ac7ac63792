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
   (trtglm.runtime.executor) with mixed prompt and output lengths at a fixed concurrency, against the
   ideal of its parts (bench/inflight.py).

Results: `runtime.json` and `runtime.png` (generated tokens/s against batch size, both
systems, and the floor) in the output folder, and a table on stdout.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from trtglm.bench import INFLIGHT_OUTPUTS, INFLIGHT_PROMPTS
from trtglm.bench.checks import (CHECK_SEQUENCES, reference_logits, check_model_logits, compare_logits, fixture_check,
                                 float32_reference_logits, hf_reference, kernel_checks, quantized_reference_logits)
from trtglm.bench.measure import (DTYPES, KIND_OF_MODE, MODES, WEIGHT_ONLY, checkpoint_tensors, copy_bandwidth,
                                  cuda_device, decode_floor_ms, fast_timing, hf_timings, long_ttft_ms,
                                  profile_decode_step, synth_tensors)
from trtglm.bench.inflight import run_mixed_workload
from trtglm.bench.report import fill_ratios, plot, summary, targets
from trtglm.errors import ModelFileError, TrtglmError, UsageError

log = logging.getLogger(__name__)


def bench_runtime(*, preset: str, dtype: str, weight_only: Sequence[str] | str, batch: Sequence[int] | int,
                  prompt_len: int, new_tokens: int, baseline: str, out: str | Path, layers: int | None,
                  long_prompt: int, requests: int, concurrency: int, prefill_chunk: int, check: bool, profile: bool,
                  tune: bool | None, seed: int, fixture: str | Path | None) -> dict:
    """Run the benchmark (see the module docstring); returns the results written to OUT/runtime.json.
    `fixture`: a trained small ChatGLM3 HF folder whose logits are checked too (skipped when None)."""
    fixture = _check_fixture(fixture)
    modes, batches = _as_list(weight_only, str), _as_list(batch, int)
    dtype_name = _check_options(preset, dtype, modes, batches, prompt_len, new_tokens, baseline, requests,
                                concurrency, prefill_chunk)
    device = cuda_device()
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
        references = {"hf": reference_logits(reference, check_ids),
                      "fp32": float32_reference_logits(cfg, hf_tensors, device, check_ids)}
        results["hf_bf16_vs_fp32"] = compare_logits(references["hf"], references["fp32"])
    results["hf"] = []
    if baseline == "hf":
        stage("hf", lambda: [asdict(t) for t in hf_timings(reference, batches, prompt_len, new_tokens, generator)])
    if check:
        compute = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16
        stage("kernel_checks", lambda: kernel_checks(ckpt_cfg, device, compute))
        if fixture is None:
            log.info("no --fixture: a trained model's logits are not checked")
        else:
            stage("fixture_check", lambda: fixture_check(fixture, device, dtype_name, prompt_len, new_tokens, generator))
    results["trtglm"] = {}
    max_seq_len = _round_up(max(prompt_len + new_tokens, long_prompt + 1, INFLIGHT_PROMPTS[1] + INFLIGHT_OUTPUTS[1]),
                            256)
    weights = Weights(cfg, hf_tensors, ckpt_cfg, trt_tensors)
    for mode in modes:
        stage(f"trtglm.{mode}", lambda mode=mode: _bench_mode(
            mode, weights, results["options"], max_seq_len, check_ids, references, results["copy_bandwidth_gbs"] * 1e9,
            generator, profile=profile, inflight=mode == modes[0] and requests > 0))
    fill_ratios(results)
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
    model = FastModel(weights.ckpt_cfg, weights.tensors, num_slots=max(max(batches), opts["concurrency"]),
                      max_seq_len=max_seq_len, weight_only=mode, tune=opts["tune"])
    entry: dict = {"weight_gb": model.weight_bytes / 1e9, "setup_s": time.perf_counter() - start}
    if references:
        if mode != "none":
            references = {**references, "quantized": quantized_reference_logits(
                weights.hf_cfg, weights.hf_tensors, MODES[mode], model.device, check_ids)}
        entry["check"] = check_model_logits(model, check_ids, references, prompt_len)
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
        entry["inflight"] = run_mixed_workload(model, opts["requests"], opts["concurrency"], generator,
                                               max_num_tokens=opts["prefill_chunk"])
    if model.tuned:
        from trtglm.runtime.fast.kernels import CHOSEN

        entry["matmul_configs"] = {str(k): v for k, v in CHOSEN.items() if k[0] == KIND_OF_MODE[mode]}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return entry


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



def _check_fixture(fixture: str | Path | None) -> Path | None:
    if fixture is None:
        return None
    path = Path(fixture).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFileError(f"--fixture {fixture}: no config.json there (a trained ChatGLM3 HF folder, "
                             "e.g. tests/fixtures/tiny-chatglm3)")
    return path


def _device_info() -> dict:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "memory_gb": props.total_memory / 1e9, "sms": props.multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
