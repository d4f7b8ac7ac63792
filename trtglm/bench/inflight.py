"""`trtglm bench inflight`: the in-flight batching executor (runtime/executor.py) against the ideal of its parts.

Closed loops through the executor (`concurrency` requests in flight, a new one as each finishes; prompt and
output lengths uniform over inclusive ranges; EOS never set):

- mixed: prompts of 32–1,024 tokens, outputs of 16–256, 256 requests at 64 in flight (the defaults);
- shared prefix: the same 1,000-token system prompt before every prompt of the mixed workload, run with prefix
  caching (`kv_cache_reuse`) off and then on; time to first token both ways.

The ideal is the time the mixed workload's work takes at the speed of its parts, each timed alone in the same
run on the same model: prompt_tokens × prefill time per token (one prompt of 1,024 tokens, or the longest the
workload draws) + decode_steps × the time of one decode step of `concurrency` sequences at the workload's mean
context, where decode_steps = ⌈(generated − requests) / concurrency⌉ (each request's first token comes from its
prefill; the others take turns in full decode batches). Generated tokens/s is reported against it.

Models: `fixture` (a small HF ChatGLM3 folder, e.g. tests/fixtures/tiny-chatglm3, converted to float32): the
portable runtime on the CPU, the fast one on a GPU; else random weights of a `preset` in the fast runtime (GPU).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trtglm.bench import INFLIGHT_OUTPUTS, INFLIGHT_PROMPTS
from trtglm.bench.measure import inflight_stats, wall_ms
from trtglm.errors import UsageError
from trtglm.conventions import TOKENS_PER_BLOCK

log = logging.getLogger(__name__)

PREFILL_PART_TOKENS = 1024  # the prompt whose prefill gives the time per prompt token


def inflight_run(model, requests: int, concurrency: int, generator: torch.Generator, prefill_tokens: int,
                 prompt_range: tuple[int, int] = INFLIGHT_PROMPTS, output_range: tuple[int, int] = INFLIGHT_OUTPUTS,
                 prefix: int = 0, kv_cache_reuse: bool = False, tokens_per_block: int = TOKENS_PER_BLOCK) -> dict:
    """Closed loop through the executor: `concurrency` requests in flight, a new one as each finishes.

    Prompt and output lengths are uniform over the given inclusive ranges; every prompt starts with the same
    `prefix` random tokens; EOS is never set. Each step carries at most `prefill_tokens` tokens (decode tokens
    and prompt chunks together)."""
    from trtglm.runtime.executor import Executor
    from trtglm.runtime.request import Request

    def uniform(low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (requests,), generator=generator, device=generator.device).tolist()

    def tokens(n: int) -> list[int]:
        return torch.randint(0, model.vocab_size, (n,), generator=generator, device=generator.device).tolist()

    lengths, outputs = uniform(*prompt_range), uniform(*output_range)
    shared = tokens(prefix)
    prompts = [shared + tokens(n) for n in lengths]
    executor = Executor(model, max_queue=requests, max_num_tokens=prefill_tokens, device=generator.device,
                        tokens_per_block=tokens_per_block, kv_cache_reuse=kv_cache_reuse)
    submitted: dict[int, float] = {}
    token_times: dict[int, list[float]] = {i: [] for i in range(requests)}
    pending = iter(range(requests))

    def submit_next() -> None:
        i = next(pending, None)
        if i is None:
            return

        def on_output(output, i=i) -> None:
            now = _now()
            token_times[i].extend([now] * len(output.tokens))
            if output.finished:
                submit_next()

        submitted[i] = _now()
        executor.submit(Request(prompts[i], outputs[i]), on_output)

    start = _now()
    for _ in range(min(concurrency, requests)):
        submit_next()
    while executor.has_work():
        executor.step()
    elapsed = _now() - start
    stats = inflight_stats(requests, concurrency, [len(p) for p in prompts], outputs, submitted, token_times, elapsed)
    done = executor.stats()
    return {**stats, "prefill_tokens_per_step": prefill_tokens, "prefill_chunks": done.prefill_chunks,
            "decode_steps": done.decode_calls, "computed_prompt_tokens": done.prefill_tokens,
            "reused_prompt_tokens": done.reused_tokens, "kv_cache_reuse": kv_cache_reuse, "prefix": prefix}


def _now() -> float:
    return time.perf_counter()


# --- the parts ------------------------------------------------------------------------------------------------------

def part_times(model, concurrency: int, prompt_len: int, context: int, generator: torch.Generator) -> dict:
    """Milliseconds of the workload's parts, each alone: the prefill of one `prompt_len`-token prompt (per prompt
    token), and one decode step of `concurrency` sequences that hold `context` tokens each."""
    prompt = torch.randint(0, model.vocab_size, (prompt_len,), generator=generator, device=generator.device).tolist()
    model.prefill([0], [prompt])  # warm-up
    prefill_ms = statistics.median(wall_ms(lambda: model.prefill([0], [prompt])) for _ in range(3))
    model.release(0)
    slots = list(range(concurrency))
    contexts = torch.randint(0, model.vocab_size, (concurrency, context), generator=generator,
                             device=generator.device).tolist()
    for slot, tokens in zip(slots, contexts):
        model.prefill([slot], [tokens])
    step = [1] * concurrency
    model.decode(slots, step)  # warm-up
    step_ms = statistics.median(wall_ms(lambda: model.decode(slots, step)) for _ in range(10))
    for slot in slots:
        model.release(slot)
    return {"prefill_prompt_tokens": prompt_len, "prefill_ms": prefill_ms, "prefill_ms_per_token": prefill_ms / prompt_len,
            "decode_batch": concurrency, "decode_context": context, "decode_step_ms": step_ms}


def with_ideal(run: dict, parts: dict) -> dict:
    """`run` with the ideal time and tokens/s of its work at the speed of `parts`, and how close it came."""
    decode_steps = math.ceil(max(0, run["generated_tokens"] - run["requests"]) / run["concurrency"])
    prefill_s = run["prompt_tokens"] * parts["prefill_ms_per_token"] / 1e3
    decode_s = decode_steps * parts["decode_step_ms"] / 1e3
    ideal_s = prefill_s + decode_s
    ideal = {"seconds": ideal_s, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
             "decode_steps": decode_steps, "tokens_per_s": run["generated_tokens"] / ideal_s}
    return {**run, "parts": parts, "ideal": ideal, "pct_of_ideal": 100 * ideal_s / run["seconds"]}


def run_mixed_workload(model, requests: int, concurrency: int, generator: torch.Generator, max_num_tokens: int,
                       prompt_range: tuple[int, int] = INFLIGHT_PROMPTS,
                       output_range: tuple[int, int] = INFLIGHT_OUTPUTS) -> dict:
    """The mixed in-flight run with its ideal (see the module docstring)."""
    context = round(sum(prompt_range) / 2 + sum(output_range) / 4)  # mean prompt and half the mean output
    parts = part_times(model, concurrency, min(PREFILL_PART_TOKENS, prompt_range[1]), context, generator)
    log.info("parts: prefill %.3f ms per prompt token, decode step of %d sequences %.2f ms", parts["prefill_ms_per_token"],
             concurrency, parts["decode_step_ms"])
    run = inflight_run(model, requests, concurrency, generator, max_num_tokens, prompt_range, output_range)
    return with_ideal(run, parts)


def shared_prefix_workload(model, requests: int, concurrency: int, generator: torch.Generator, max_num_tokens: int,
                           prefix: int, tokens_per_block: int, prompt_range: tuple[int, int] = INFLIGHT_PROMPTS,
                           output_range: tuple[int, int] = INFLIGHT_OUTPUTS) -> dict:
    """The same requests (same seed) with prefix caching off, then on."""
    seed = int(torch.randint(0, 2**31, (1,), generator=generator, device=generator.device))
    runs = {}
    for reuse in (False, True):
        generator.manual_seed(seed)
        runs["on" if reuse else "off"] = inflight_run(model, requests, concurrency, generator, max_num_tokens,
                                                      prompt_range, output_range, prefix, reuse, tokens_per_block)
    return runs


# --- the command ---------------------------------------------------------------------------------------------------

def bench_inflight(*, fixture: str | Path | None, preset: str, weight_only: str, requests: int, concurrency: int,
                   prompts: tuple[int, int] | str, outputs: tuple[int, int] | str, prefix: int, max_num_tokens: int,
                   tokens_per_block: int, seed: int, out: str | Path) -> dict:
    """Both workloads on one model (see the module docstring); results in OUT/inflight.json and on stdout."""
    prompts, outputs = _check(requests, concurrency, prompts, outputs, prefix, max_num_tokens, tokens_per_block)
    max_seq_len = -(-(prefix + prompts[1] + outputs[1] + 1) // 64) * 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as work:
        model, name = _model(fixture, preset, weight_only, concurrency, max_seq_len, device, Path(work))
        generator = torch.Generator(device=device).manual_seed(seed)
        results = {"model": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "options": {"requests": requests, "concurrency": concurrency, "prompts": list(prompts),
                               "outputs": list(outputs), "prefix": prefix, "max_num_tokens": max_num_tokens,
                               "tokens_per_block": tokens_per_block, "seed": seed}}
        results["mixed"] = run_mixed_workload(model, requests, concurrency, generator, max_num_tokens, prompts, outputs)
        results["shared_prefix"] = shared_prefix_workload(model, requests, concurrency, generator, max_num_tokens,
                                                          prefix, tokens_per_block, prompts, outputs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inflight.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print("\n".join(summary(results)))
    return results


def summary(results: dict) -> list[str]:
    mixed, shared = results["mixed"], results["shared_prefix"]
    parts = mixed["parts"]
    return [
        f"in-flight on {results['model']} ({results['device']}): {mixed['requests']} requests, {mixed['concurrency']} "
        f"in flight, up to {results['options']['max_num_tokens']} tokens a step",
        f"parts: prefill {parts['prefill_ms'] / parts['prefill_prompt_tokens'] * 1024:.2f} ms per 1,024 prompt tokens, "
        f"decode step of {parts['decode_batch']} at context {parts['decode_context']} {parts['decode_step_ms']:.2f} ms",
        f"mixed: {mixed['tokens_per_s']:.1f} generated tokens/s; ideal {mixed['ideal']['tokens_per_s']:.1f} "
        f"({mixed['pct_of_ideal']:.0f}% of it); TTFT p50/p99 {_ms(mixed['ttft_ms'])} ms, inter-token p50/p99 "
        f"{_ms(mixed['itl_ms'])} ms",
        f"shared {results['options']['prefix']}-token prefix: TTFT p50 {shared['off']['ttft_ms']['p50']:.1f} ms with "
        f"reuse off, {shared['on']['ttft_ms']['p50']:.1f} ms on ({shared['on']['reused_prompt_tokens']} of "
        f"{shared['on']['prompt_tokens']} prompt tokens reused); {shared['off']['tokens_per_s']:.1f} → "
        f"{shared['on']['tokens_per_s']:.1f} generated tokens/s",
    ]


def _ms(pair: dict) -> str:
    return f"{pair['p50']:.1f}/{pair['p99']:.1f}"


def _model(fixture, preset: str, weight_only: str, num_slots: int, max_seq_len: int, device: torch.device,
           work: Path):
    """(SlotModel, its name): the fixture converted into `work`, or a preset's random weights (GPU)."""
    if fixture is not None:
        from trtglm.convert.writer import convert_checkpoint

        checkpoint = convert_checkpoint(Path(fixture), work / "checkpoint", dtype="float32", tp_size=1, pp_size=1,
                                        weight_only=None, fp8=False, fp8_kv_cache=False, calibration_prompts=None,
                                        chatglm_version="auto", force=False)
        if device.type == "cuda":
            from trtglm.runtime.fast import load_fast_model

            return load_fast_model(checkpoint, num_slots=num_slots, max_seq_len=max_seq_len, device=device,
                                   weight_only=weight_only), f"{Path(fixture).name} (fast runtime)"
        from trtglm.runtime.model import load_model
        from trtglm.runtime.slot_runtime import ShardedSlotModel

        return ShardedSlotModel(load_model(checkpoint), num_slots, max_seq_len), \
            f"{Path(fixture).name} (portable runtime)"
    if device.type != "cuda":
        raise UsageError("random preset weights run on a GPU; on the CPU give --fixture tests/fixtures/tiny-chatglm3")
    from trtglm.bench.measure import checkpoint_tensors, synth_tensors
    from trtglm.runtime.fast import FastModel

    cfg, hf_tensors = synth_tensors(preset, None, "bfloat16", 0, device)
    ckpt_cfg, tensors = checkpoint_tensors(cfg, hf_tensors, "bfloat16")
    return FastModel(ckpt_cfg, tensors, num_slots=num_slots, max_seq_len=max_seq_len, device=device,
                     weight_only=weight_only), f"random {preset} bf16 weight-only {weight_only} (fast runtime)"


def _check(requests: int, concurrency: int, prompts, outputs, prefix: int, max_num_tokens: int,
           tokens_per_block: int) -> tuple[tuple[int, int], tuple[int, int]]:
    ranges = []
    for flag, value in (("--prompts", prompts), ("--outputs", outputs)):
        parts = [int(v) for v in str(value).strip("()[] ").replace(" ", "").split(",") if v] \
            if isinstance(value, str) else [int(v) for v in value]
        if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
            raise UsageError(f"{flag} takes LOW,HIGH with 1 <= LOW <= HIGH, not {value!r}")
        ranges.append((parts[0], parts[1]))
    if requests < 1 or concurrency < 1 or prefix < 0 or max_num_tokens < 1 or tokens_per_block < 1:
        raise UsageError("--requests, --concurrency, --max-num-tokens and --tokens-per-block must be >= 1, "
                         "--prefix >= 0")
    return ranges[0], ranges[1]
