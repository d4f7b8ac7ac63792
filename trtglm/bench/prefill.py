"""Time to first token of one prompt with the fast runtime's prefill graphs and launched eagerly, in one process.

For each weight kind, one FastModel on random ChatGLM3-6B-shaped weights (as `bench runtime` makes them, max_seq_len
1,280 as there) prefills one prompt of 128, 512 and 1,000 tokens with `use_graph` on and off in turns, five times
each: the median wall time to the synchronised logits, and the largest difference between the two paths' logits.

    trtglm bench prefill [--kinds none,int8,int4] [--out results.json]
"""

from __future__ import annotations

import statistics
import time

import torch

from trtglm.bench.measure import run_kinds
from trtglm.runtime.fast import FastModel

PROMPT_LENGTHS = (128, 512, 1000)
REPEATS = 5


def prefill_ms(model: FastModel, prompt: list[int], use_graph: bool) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits = model.prefill([0], [prompt], use_graph=use_graph)
    torch.cuda.synchronize()
    model.release(0)
    return (time.perf_counter() - start) * 1e3, logits


def bench_kind(mode: str, ckpt_cfg, tensors: dict, generator: torch.Generator) -> dict:
    start = time.perf_counter()
    model = FastModel(ckpt_cfg, tensors, num_slots=64, max_seq_len=1280, weight_only=mode)
    results = {"setup_s": time.perf_counter() - start, "prompts": []}
    print(f"{mode:5} start-up {results['setup_s']:.1f} s", flush=True)
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, model.vocab_size, (length,), device=generator.device, generator=generator).tolist()
        times, logits = {True: [], False: []}, {}
        for _ in range(REPEATS):
            for use_graph in (True, False):
                ms, logits[use_graph] = prefill_ms(model, prompt, use_graph)
                times[use_graph].append(ms)
        row = {"tokens": length, "graph_ms": statistics.median(times[True]),
               "eager_ms": statistics.median(times[False]),
               "max_abs_diff": float((logits[True] - logits[False]).abs().max())}
        results["prompts"].append(row)
        print(f"{mode:5} {length:5d} tokens: graph {row['graph_ms']:.1f} ms, eager {row['eager_ms']:.1f} ms, "
              f"max |Δlogit| {row['max_abs_diff']:.3f}", flush=True)
    return results


def run(kinds: str, out: str | None) -> None:
    run_kinds(kinds, out, bench_kind)
