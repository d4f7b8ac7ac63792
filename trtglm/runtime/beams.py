"""Beam search by the rules TensorRT-LLM's beam search kernels share with transformers' `generate()`.

Each step takes the log-softmax of every running beam's processed logits (`[beams, vocab]`), adds
each beam's cumulative log probability and keeps the best `2 × width` continuations over all
beams. A continuation that ends its beam (the end id, a stop word, or the last allowed token)
becomes a finished hypothesis when it ranks among the first `width`, scored by its cumulative
log probability over `generated ** length_penalty` (generated counts the ending token); the best
`width` unfinished ones run on. The first step starts from the prompt alone. Searching stops
when every continuation ends, or `width` hypotheses are finished and either `early_stopping` is
True or no running beam can still beat the worst of them: the best running score over the
current length (early_stopping False), or over `max_tokens` when early_stopping is "never"
and the length penalty positive. TensorRT-LLM's integer early_stopping maps 1 -> True,
0 -> False, anything else -> "never". The answer is the `width` finished hypotheses, best first
(topped up with running beams should fewer have finished).

In the executor, `RequestBeams` is a request's search: the slot each running beam's cache is in, and its beams'
logits processed by the request's settings.

Beams do not sample: temperature, top-k and top-p play no part (transformers' `do_sample=False`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trtglm.errors import UsageError
from trtglm.request_config import early_stopping_mode
from trtglm.runtime.request import Beam, Output, Request
from trtglm.runtime.sampling import BadWords, held_until_min_tokens, processed

UNREACHABLE = -1.0e9  # the score of a beam that may not be chosen (transformers' and TensorRT-LLM's constant)


class BeamSearch:
    """One request's beams. `step(log_probs)` advances them; `done` tells when to stop; `result()` the answer."""

    def __init__(self, width: int, max_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool | int | str = True, ends: Callable[[list[int]], bool] = lambda tokens: False):
        if width < 1 or max_tokens < 1:
            raise UsageError(f"need beam_width >= 1 and max_tokens >= 1, not {width} and {max_tokens}")
        self.width, self.max_tokens, self.length_penalty = width, max_tokens, length_penalty
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
        hits = torch.tensor([self.ends(c) or len(c) >= self.max_tokens for c in candidates])
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
        length = self.max_tokens if never else self.generated
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


class RequestBeams:
    """A beam-search request's beams in the executor: its `BeamSearch`, the slot each running beam's cache is in
    (`slots`, given at admission), and its beams' logits processed by its settings, each beam's own history counted
    (bias, bans, penalties; beams do not sample: no temperature)."""

    def __init__(self, request: Request):
        sampling = request.sampling
        self.request = request
        self.search = BeamSearch(sampling.beam_width, request.max_tokens, sampling.length_penalty,
                                 sampling.early_stopping, ends_with_any(request.end_id, request.stop_words))
        self.bad_words = BadWords(request.bad_words)
        self.slots: list[int] = []

    @property
    def done(self) -> bool:
        return self.search.done

    def decode_rows(self, prompt_length: int) -> list[tuple[int, int]]:
        """(slot, position) of each running beam's next decode token."""
        return [(slot, prompt_length + len(tokens) - 1)
                for slot, tokens in zip(self.slots, self.search.running, strict=True)]

    def last_tokens(self) -> list[int]:
        return [tokens[-1] for tokens in self.search.running]

    def step(self, logits: torch.Tensor, prompt: list[int], vocab_limit: int) -> list[int]:
        """Advance the search by the logits of its beams (`[beams, vocab]`, processed here, ids from `vocab_limit`
        on never chosen) after `prompt`; each new beam's parent."""
        request = self.request
        raw = logits.float().cpu().numpy() if request.output.return_generation_logits else None
        histories = [prompt + tokens for tokens in self.search.running]
        sampling = request.sampling
        penalties = (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) \
            if sampling.penalised else None
        banned = [self._banned(history, len(prompt)) for history in histories]
        rows = processed(logits[:, :vocab_limit], request.embedding_bias, banned, penalties, histories)
        return self.search.step(torch.log_softmax(rows, dim=-1), raw)

    def follow(self, parents: Sequence[int]) -> tuple[list[int], list[int]]:
        """Each new beam's slot after `step` gave `parents`: the (sources, targets) of the slot copies that makes."""
        self.slots, sources, targets = continued_slots(self.slots, parents)
        return sources, targets

    def output(self) -> Output:
        """The finished search's answer: every beam, best first, without its end id (as a single sequence's);
        log probabilities (each token's, and the sum with the end id's) only when asked for."""
        end_id, asked, found, beams = self.request.end_id, self.request.output.return_log_probs, self.search.result(), []
        for beam in found:
            cut = len(beam.tokens) - (end_id is not None and beam.tokens[-1] == end_id)
            beams.append(Beam(beam.tokens[:cut], beam.cum_log_prob if asked else 0.0, beam.score,
                              beam.log_probs[:cut] if asked else [], beam.logits[:cut]))
        best, ended = beams[0], found[0].tokens
        reason = "end_id" if len(ended) > len(best.tokens) else "stop_word" if self.search.ends(ended) else "length"
        return Output(best.tokens, best.log_probs, finished=True, reason=reason, beams=beams)

    def _banned(self, history: list[int], prompt_length: int) -> list[int]:
        """The ids banned after `history` (the prompt and a beam's tokens)."""
        banned = self.bad_words.banned(history)
        if len(history) - prompt_length < self.request.sampling.min_tokens:
            banned += held_until_min_tokens(self.request.end_id, self.request.stop_words)
        return banned
