"""Decode steps of the fast runtime with and without programmatic dependent launch, in one process, on the GPU.

For each weight kind, one FastModel on random ChatGLM3-6B-shaped weights (as `bench runtime` makes them) runs a
greedy decode (128-token prompts, 127 steps, `bench runtime`'s timing) at batch 1 and 8, with its decode graphs
captured with programmatic dependent launch on, then off, then on again; and the logits of five decode steps of
one sequence are compared between on and off (the launch mode must not change a single bit).

    trtglm bench pdl [--kinds none,int8,int4] [--out results.json]
"""

from __future__ import annotations


import torch

from trtglm.bench.measure import fast_timing, run_kinds
from trtglm.runtime.fast import FastModel, kernels

STEPS_COMPARED = 5


def greedy_logits(model: FastModel, prompt: list[int]) -> torch.Tensor:
    """Logits of the first STEPS_COMPARED decode steps after `prompt`, in slot 0."""
    token = model.prefill([0], [prompt]).argmax(-1)
    steps = []
    for _ in range(STEPS_COMPARED):
        logits = model.decode([0], token)
        steps.append(logits)
        token = logits.argmax(-1)
    model.release(0)
    return torch.stack(steps)


def bench_kind(mode: str, ckpt_cfg, tensors: dict, generator: torch.Generator) -> dict:
    model = FastModel(ckpt_cfg, tensors, num_slots=8, max_seq_len=512, weight_only=mode)
    prompt = torch.randint(0, model.vocab_size, (64,), device=generator.device, generator=generator).tolist()
    runs, logits = [], {}
    for pdl in (True, False, True):
        kernels.PDL_ENABLED = pdl
        model.capture_graphs()  # replaces every bucket's graph: launches take the setting as they are captured
        logits.setdefault(pdl, greedy_logits(model, prompt))
        steps = {batch: fast_timing(model, batch, 128, 128, generator).decode_ms for batch in (1, 8)}
        runs.append({"pdl": pdl, "ms_per_step": steps})
        print(f"{mode:5} PDL {'on ' if pdl else 'off'}: batch 1 {steps[1]:.3f} ms/step, batch 8 {steps[8]:.3f} ms/step",
              flush=True)
    kernels.PDL_ENABLED = True
    identical = bool(torch.equal(logits[True], logits[False]))
    print(f"{mode:5} logits identical with and without PDL: {identical}", flush=True)
    return {"runs": runs, "logits_identical": identical}


def run(kinds: str, out: str | None) -> None:
    run_kinds(kinds, out, bench_kind)
