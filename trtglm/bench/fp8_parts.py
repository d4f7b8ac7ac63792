"""`bench fp8`'s measurements of one model (fp8.py runs them for the unquantized model, then the FP8 one):

- accuracy: every prompt's greedy continuation of `steps` tokens, and the teacher-forced logits of the unquantized
  model's sequences (prompt and continuation), compared position by position with the unquantized model's: cosine
  similarity, top-1 agreement, and how many greedy tokens are the same (leading, and in all);
- speed: the weights held and read, a KV-cache position's bytes and how many positions the memory the weights leave
  holds, the batch-1 decode step (CUDA-graph replays, the context growing from `prompt_len`), the prefill of
  `prefill_prompts` prompts of `prefill_len` tokens together (tokens/s), and the in-flight executor serving
  `requests` of `prompt_len` → `new_tokens` at `concurrency` in flight (generated tokens/s).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtglm.bench.inflight import inflight_run
from trtglm.bench.measure import wall_ms
from trtglm.conventions import FREE_GPU_MEM_FRACTION
from trtglm.runtime.fast.model import kv_positions


@dataclass(frozen=True)
class Load:
    steps: int  # greedy tokens compared
    requests: int
    concurrency: int
    prompt_len: int
    new_tokens: int
    prefill_prompts: int
    prefill_len: int
    max_num_tokens: int  # tokens an executor step carries


# --- accuracy -------------------------------------------------------------------------------------------------------

def greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `steps` tokens, all prompts decoding together."""
    slots = list(range(len(prompts)))
    tokens = model.prefill(slots, prompts).argmax(-1)
    chosen = [tokens]
    for _ in range(steps - 1):
        tokens = model.decode(slots, tokens).argmax(-1)
        chosen.append(tokens)
    for slot in slots:
        model.release(slot)
    return torch.stack(chosen, dim=1).tolist()


def sequences_and_logits(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(each prompt's greedy continuation, the teacher-forced float32 logits of prompt + continuation, on the CPU)."""
    continuations = greedy(model, prompts, steps)
    return continuations, [model.score(p + c).cpu() for p, c in zip(prompts, continuations)]


def compare(model, prompts: list[list[int]], baseline: tuple[list[list[int]], list[torch.Tensor]],
            steps: int) -> list[dict]:
    """Per prompt: `model`'s logits against the baseline's over the baseline's sequence, and greedy agreement."""
    continuations, logits = baseline
    own = greedy(model, prompts, steps)
    rows = []
    for prompt, theirs, mine, reference in zip(prompts, continuations, own, logits):
        scored = model.score(prompt + theirs).cpu()
        cosine = F.cosine_similarity(scored, reference, dim=-1)
        same = [a == b for a, b in zip(mine, theirs)]
        rows.append({"tokens": len(prompt) + len(theirs), "cosine_mean": float(cosine.mean()),
                     "cosine_min": float(cosine.min()),
                     "top1": float((scored.argmax(-1) == reference.argmax(-1)).float().mean()),
                     "greedy_same_prefix": same.index(False) if False in same else len(same),
                     "greedy_same": sum(same) / len(same)})
    return rows


def accuracy_summary(rows: list[dict], steps: int) -> dict:
    positions = sum(r["tokens"] for r in rows)
    return {"prompts": len(rows), "positions": positions, "steps": steps,
            "cosine_mean": sum(r["cosine_mean"] * r["tokens"] for r in rows) / positions,
            "cosine_min": min(r["cosine_min"] for r in rows),
            "worst_prompt_cosine_mean": min(r["cosine_mean"] for r in rows),
            "top1": sum(r["top1"] * r["tokens"] for r in rows) / positions,
            "greedy_same_prefix_median": statistics.median(r["greedy_same_prefix"] for r in rows),
            "greedy_same": sum(r["greedy_same"] for r in rows) / len(rows), "by_prompt": rows}


# --- speed ----------------------------------------------------------------------------------------------------------

def speed(model, load: Load, generator: torch.Generator) -> dict:
    return {**memory(model), "decode_step_ms_batch1": decode_step_ms(model, load, generator),
            "prefill": prefill_rate(model, load, generator), "inflight": served_rate(model, load, generator)}


def held_weight_bytes(model) -> int:
    """Bytes of every weight the model holds: embedding, norms, linears (with their scales and biases), lm_head."""
    tensors = [model.embedding, model.final_norm, *(t for w in model.layers for t in (w.input_norm, w.post_norm))]
    for linear in model.linears:
        tensors += [t for t in (linear.stored, linear.scale, linear.input_scale, linear.bias) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory(model) -> dict:
    held, per_position = held_weight_bytes(model), model.kv_bytes_per_position
    found = {"weight_bytes": held, "weight_bytes_read_per_step": model.weight_bytes,
             "kv_bytes_per_position": per_position, "kv_positions_per_gib": (1 << 30) // per_position}
    if model.device.type == "cuda":  # alone on this GPU: the share of what the weights leave a KV cache may take
        total = torch.cuda.get_device_properties(model.device).total_memory
        found["kv_positions_beside_weights"] = kv_positions(total - held, FREE_GPU_MEM_FRACTION, per_position,
                                                            model.block_size)
    return found


def _tokens(model, count: int, length: int, generator: torch.Generator) -> list[list[int]]:
    return torch.randint(0, model.vocab_size, (count, length), generator=generator, device=generator.device).tolist()


def decode_step_ms(model, load: Load, generator: torch.Generator) -> float:
    """ms per decode step of one sequence, from a prompt of prompt_len tokens on, `new_tokens` steps timed."""
    prompt = _tokens(model, 1, load.prompt_len, generator)
    tokens = model.prefill([0], prompt).argmax(-1)
    for _ in range(3):  # warm-up
        tokens = model.decode([0], tokens).argmax(-1)

    def steps() -> None:
        nonlocal tokens
        for _ in range(load.new_tokens):
            tokens = model.decode([0], tokens).argmax(-1)

    ms = wall_ms(steps) / load.new_tokens
    model.release(0)
    return ms


def prefill_rate(model, load: Load, generator: torch.Generator, repeats: int = 3) -> dict:
    """Prompt tokens/s of one prefill of `prefill_prompts` prompts of `prefill_len` tokens together."""
    slots = list(range(load.prefill_prompts))
    prompts = _tokens(model, load.prefill_prompts, load.prefill_len, generator)

    def prefill() -> None:
        model.prefill(slots, prompts)
        for slot in slots:
            model.release(slot)

    prefill()  # warm-up
    ms = statistics.median(wall_ms(prefill) for _ in range(repeats))
    tokens = load.prefill_prompts * load.prefill_len
    return {"prompts": load.prefill_prompts, "tokens": tokens, "ms": ms, "tokens_per_s": tokens / ms * 1e3}


def served_rate(model, load: Load, generator: torch.Generator) -> dict:
    """The in-flight executor's closed loop (bench inflight's), after a shorter one that warms it up."""
    shape = {"prompt_range": (load.prompt_len, load.prompt_len), "output_range": (load.new_tokens, load.new_tokens),
             "tokens_per_block": model.block_size}
    inflight_run(model, min(load.requests, load.concurrency), load.concurrency, generator, load.max_num_tokens,
                 **shape)
    run = inflight_run(model, load.requests, load.concurrency, generator, load.max_num_tokens, **shape)
    keys = ("requests", "concurrency", "generated_tokens", "seconds", "tokens_per_s", "ttft_ms", "itl_ms",
            "decode_steps", "prefill_chunks")
    return {key: run[key] for key in keys}
