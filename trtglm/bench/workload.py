"""The served benchmark's workloads: requests (a prompt text and a max_tokens each) to run as a
closed loop of `concurrency` in flight (stream_load.py runs them), fixed or mixed in length.

Prompts: `prompt_text` builds, from the tokenizer's own pieces, a text whose chat prompt
(`[gMASK] sop <|user|> \\n … <|assistant|>`, as preprocessing builds it) has exactly the asked
number of ids; the actual counts are recorded with the workload.

Random weights (synth-model) emit random ids and may stop early at `end_id` or a stop word
(`<|user|>`, `<|observation|>`), which preprocessing always adds: requests are not forced to
their max_tokens, and every count of the runs is of tokens actually generated.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from trtglm.errors import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """Requests to run as a closed loop of `concurrency` in flight."""

    name: str
    texts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]  # what preprocessing makes of each text
    max_tokens: tuple[int, ...]
    concurrency: int

    @property
    def requests(self) -> int:
        return len(self.texts)

    def describe(self) -> dict:
        lengths = [len(ids) for ids in self.prompt_ids]
        return {"name": self.name, "requests": self.requests, "concurrency": self.concurrency,
                "prompt_tokens": {"total": sum(lengths), "min": min(lengths), "max": max(lengths)},
                "max_tokens": {"total": sum(self.max_tokens), "min": min(self.max_tokens),
                               "max": max(self.max_tokens)}}


def piece_pool(tokenizer) -> list[str]:
    """The tokenizer's ordinary pieces as text (no control, unknown or byte pieces, nothing JSON-like)."""
    sp = tokenizer.sp
    pool = []
    for i in range(sp.vocab_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        piece = sp.id_to_piece(i).replace("\u2581", " ")
        if piece.strip() and not any(c in piece for c in "{[\\\"\n\r\t") and "\ufffd" not in piece:
            pool.append(piece)
    if not pool:
        raise UsageError("the tokenizer has no ordinary pieces to build prompts from")
    return pool


def prompt_text(tokenizer, target: int, rng: random.Random, pool: Sequence[str] | None = None) -> str:
    """A text whose chat prompt (preprocessing's ids) has `target` ids, or as close as the pieces allow."""
    from trtglm.chatglm.chat import prompt_ids

    pool = pool or piece_pool(tokenizer)
    count = lambda text: len(prompt_ids(tokenizer, text))  # noqa: E731
    overhead = count("a") - len(tokenizer.sp.encode("a"))
    if target <= overhead:
        raise UsageError(f"a prompt needs more than the chat template's {overhead} ids, not {target}")
    text = ""
    while True:
        text += "".join(rng.choice(pool) for _ in range(target))
        text = text.lstrip()
        while text and not text[0].isalnum():
            text = text[1:]
        if text and count(text) >= target:
            break
    low, high = 1, len(text)  # the shortest prefix with at least `target` ids
    while low < high:
        middle = (low + high) // 2
        if count(text[:middle]) >= target:
            high = middle
        else:
            low = middle + 1
    best = text[:low]
    for k in range(low, max(0, low - 8), -1):  # a prefix that lands exactly (tokens may merge as text grows)
        if text[:k].strip() and count(text[:k]) == target:
            return text[:k]
    return best


def _workload(name: str, tokenizer, lengths: list[int], outputs: list[int], concurrency: int,
              rng: random.Random) -> Workload:
    from trtglm.chatglm.chat import prompt_ids

    pool = piece_pool(tokenizer)
    texts = [prompt_text(tokenizer, n, rng, pool) for n in tqdm(lengths, desc=f"{name}: prompts", unit="prompt",
                                                               disable=None, leave=False)]
    ids = tuple(tuple(prompt_ids(tokenizer, text)) for text in texts)
    off = sum(len(i) != n for i, n in zip(ids, lengths))
    if off:
        log.warning("%s: %d of %d prompts could not be built to their exact length", name, off, len(texts))
    return Workload(name, tuple(texts), ids, tuple(outputs), concurrency)


def fixed_workload(tokenizer, requests: int, concurrency: int, prompt_len: int, new_tokens: int,
                   seed: int) -> Workload:
    """`requests` prompts of `prompt_len` ids (chat template included), `new_tokens` each."""
    _check_counts(requests, concurrency)
    return _workload(f"fixed {prompt_len}/{new_tokens}", tokenizer, [prompt_len] * requests, [new_tokens] * requests,
                     concurrency, random.Random(seed))


def mixed_workload(tokenizer, requests: int, concurrency: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int], seed: int) -> Workload:
    """Prompt and output lengths uniform over the inclusive ranges (as `inflight_run` draws them)."""
    _check_counts(requests, concurrency)
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_range) for _ in range(requests)]
    outputs = [rng.randint(*output_range) for _ in range(requests)]
    return _workload(f"mixed {prompt_range[0]}-{prompt_range[1]}/{output_range[0]}-{output_range[1]}", tokenizer,
                     lengths, outputs, concurrency, rng)


def _check_counts(requests: int, concurrency: int) -> None:
    for name, value in (("requests", requests), ("concurrency", concurrency)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"--{name} must be a whole number ≥ 1, not {value!r}")
