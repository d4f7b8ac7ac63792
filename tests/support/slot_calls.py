"""One fixed series of `SlotModel` calls (prefill, greedy decode steps, a mixed step, score, prefill_all)
whose logits the tensor-parallel tests compare between processes: every rank of a tp-N model makes the
same calls, as the followers of a served one do, and rank 0 keeps what they return."""

from __future__ import annotations

import torch

SLOTS = (0, 2, 3)  # the prompts' slots; slot 1 takes the mixed step's new prompt
MIXED_CHUNK = 5  # tokens of the mixed step's new prompt


def prompts(vocab: int, lengths: tuple[int, ...] = (11, 7, 3), seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_calls(model, prompt_ids: list[list[int]], steps: int) -> dict[str, torch.Tensor]:
    """prefill: `[n, vocab]`; decode: `[steps, n, vocab]`; ids: `[n, steps + 1]` the greedy tokens; mixed:
    `[2, vocab]` (the first slot's next token beside a new prompt chunk in slot 1); score: `[len, vocab]` of the
    first prompt; every_position: `[len, vocab]`, prefill_all of the second prompt into slot 1 (a request asking
    for its context logits)."""
    slots = list(SLOTS[:len(prompt_ids)])
    results = {"prefill": model.prefill(slots, prompt_ids)}
    tokens = results["prefill"].argmax(-1)
    ids, decoded = [tokens], []
    for _ in range(steps):
        logits = model.decode(slots, tokens.tolist())
        decoded.append(logits)
        tokens = logits.argmax(-1)
        ids.append(tokens)
    results["decode"] = torch.stack(decoded)
    results["ids"] = torch.stack(ids, dim=1)
    start = len(prompt_ids[0]) + steps
    results["mixed"] = model.step([slots[0], 1], [[int(tokens[0])], prompt_ids[1][:MIXED_CHUNK]], [start, 0])
    results["score"] = model.score(prompt_ids[0])
    model.release(1)
    results["every_position"] = model.prefill_all(1, prompt_ids[1])
    return {name: (t.float() if t.is_floating_point() else t).cpu().contiguous() for name, t in results.items()}
