"""Beam search by the rules TensorRT-LLM's beam search kernels share with transformers' `generate()`.

Each step takes the log-softmax of every running beam's processed logits (`[beams, vocab]`), adds
each beam's cumulative log probability and keeps the best `2 × width` continuations over all
beams. A continuation that ends its beam (the end id, a stop word, or the last allowed token)
becomes a finished hypothesis when it ranks among the first `width`, scored by its cumulative
log probability over `generated ** length_penalty` (generated counts the ending token); the best
`width` unfinished ones run on. The first step starts from the prompt alone. Searching stops
when every continuation ends, or `width` hypotheses are finished and either `early_stopping` is
True or no running beam can still beat the worst of them: the best running score over the
current length (early_stopping False), or over `max_new_tokens` when early_stopping is "never"
and the length penalty positive. TensorRT-LLM's integer early_stopping maps 1 -> True,
0 -> False, anything else -> "never". The answer is the `width` finished hypotheses, best first
(topped up with running beams should fewer have finished).

Beams do not sample: temperature, top-k and top-p play no part (transformers' `do_sample=False`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from trtglm.errors import UsageError
from trtglm.request_config import early_stopping_mode

UNREACHABLE = -1.0e9  # the score of a beam that may not be chosen (transformers' and TensorRT-LLM's constant)


@dataclass
class Beam:
    tokens: list[int]  # generated, the ending token included
    cum_log_prob: float
    score: float  # cum_log_prob / len(tokens) ** length_penalty: what beams are ranked by
    log_probs: list[float] = field(default_factory=list)  # each token's
    logits: list = field(default_factory=list, compare=False)  # the raw logits row each token was chosen from


class BeamSearch:
    """One request's beams. `step(log_probs)` advances them; `done` tells when to stop; `result()` the answer."""

    def __init__(self, width: int, max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool | int | str = True, ends: Callable[[list[int]], bool] = lambda tokens: False):
        if width < 1 or max_new_tokens < 1:
            raise UsageError(f"need beam_width >= 1 and max_new_tokens >= 1, not {width} and {max_new_tokens}")
        self.width, self.max_new_tokens, self.length_penalty = width, max_new_tokens, length_penalty
        self.early_stopping = early_stopping_mode(early_stopping)
        self.ends = ends
        self.running: list[list[int]] = [[]]
        self.running_log_probs: list[list[float]] = [[]]
        self.running_logits: list[list] = [[]]  # each running beam's raw rows, when `step` is given them
        self.scores = torch.zeros(1)
        self.finished: list[Beam] = []
        self.improvable = True  # a running beam may still beat the worst finished one
        self.generated = 0
        self.done = False

    @property
    def full(self) -> bool:
        return len(self.finished) >= self.width

    def step(self, log_probs: torch.Tensor, rows: Sequence | None = None) -> list[int]:
        """Advance by one token: `log_probs` `[running beams, vocab]` (float32); `rows`, one per running beam, are
        kept with the tokens chosen from them (a request's raw logits). Returns, for each new running beam, the
        index of the running beam it continues (the first step: 0)."""
        first = len(self.running) == 1
        if first:  # the prompt stands in for every beam; all but one may not be chosen
            log_probs = log_probs.expand(self.width, -1)
            self.scores = torch.tensor([0.0] + [UNREACHABLE] * (self.width - 1))
        vocab = log_probs.shape[-1]
        top, index = torch.topk((log_probs + self.scores[:, None]).reshape(-1), 2 * self.width)
        parents = [0 if first else p for p in (index // vocab).tolist()]
        tokens = (index % vocab).tolist()
        candidates = [self.running[p] + [t] for p, t in zip(parents, tokens)]
        kept = [self.running_logits[p] + ([] if rows is None else [rows[p]]) for p in parents]
        token_log_probs = log_probs[index // vocab, index % vocab].tolist()
        hits = torch.tensor([self.ends(c) or len(c) >= self.max_new_tokens for c in candidates])
        self.generated += 1
        self._finish(candidates, parents, token_log_probs, top, hits, kept)
        running_scores = top + hits.float() * UNREACHABLE
        order = torch.topk(running_scores, self.width).indices.tolist()
        self.running_log_probs = [self.running_log_probs[parents[i]] + [token_log_probs[i]] for i in order]
        self.running_logits = [kept[i] for i in order]
        self.running = [candidates[i] for i in order]
        self.scores = running_scores[order]
        self._check_improvable()
        self.done = not self.improvable or (self.full and self.early_stopping is True) or bool(hits.all())
        return [parents[i] for i in order]

    def _finish(self, candidates: list[list[int]], parents: list[int], token_log_probs: list[float],
                top: torch.Tensor, hits: torch.Tensor, kept: list[list]) -> None:
        """The first `width` continuations that end become finished hypotheses, unless finished ones may no
        longer change."""
        if not self.improvable or (self.full and self.early_stopping is True):
            return
        normed = top / (self.generated ** self.length_penalty)
        for i in range(self.width):
            if hits[i]:
                self.finished.append(Beam(candidates[i], float(top[i]), float(normed[i]),
                                          self.running_log_probs[parents[i]] + [token_log_probs[i]], kept[i]))
        self.finished = sorted(self.finished, key=lambda beam: -beam.score)[:self.width]

    def _check_improvable(self) -> None:
        if not self.improvable or not self.full:
            return
        never = self.early_stopping == "never" and self.length_penalty > 0
        length = self.max_new_tokens if never else self.generated
        best_running = self.scores[:1] / (length ** self.length_penalty)
        self.improvable = bool(best_running > min(beam.score for beam in self.finished))

    def result(self) -> list[Beam]:
        """The `width` best hypotheses, best first."""
        beams = list(self.finished)
        for tokens, log_probs, score, rows in zip(self.running, self.running_log_probs, self.scores.tolist(),
                                                  self.running_logits):
            if len(beams) >= self.width:
                break
            beams.append(Beam(tokens, score, score / len(tokens) ** self.length_penalty, log_probs, rows))
        return sorted(beams, key=lambda beam: -beam.score)[:self.width]


def ends_with_any(end_id: int | None, stop_words: Sequence[Sequence[int]]) -> Callable[[list[int]], bool]:
    """Whether generated tokens end a beam: the end id, or a stop word just completed."""
    words = [[int(t) for t in w] for w in stop_words if len(w)]

    def ends(tokens: list[int]) -> bool:
        return (end_id is not None and tokens[-1] == end_id) or any(tokens[-len(w):] == w for w in words)

    return ends


def continued_slots(slots: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Where each new beam's cache lives, when beam i moves on from beam `parents[i]` (`slots`: each old beam's
    slot): the first beam to continue a parent keeps its slot; the others take the slots of beams that nobody
    continues, which get a copy of their parent's. Returns (new slots, copy sources, copy targets)."""
    new: list[int | None] = [None] * len(parents)
    kept: set[int] = set()
    for i, parent in enumerate(parents):
        if parent not in kept:
            kept.add(parent)
            new[i] = slots[parent]
    spare = [slot for j, slot in enumerate(slots) if j not in kept]
    sources, targets = [], []
    for i, parent in enumerate(parents):
        if new[i] is None:
            new[i] = spare.pop(0)
            sources.append(slots[parent])
            targets.append(new[i])
    return new, sources, targets
