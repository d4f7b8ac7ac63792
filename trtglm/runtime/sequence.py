"""`SequenceState`: one request's state in the executor (executor.py) from submission to its last `Output`: its
tokens so far, how much of its prompt is prefilled, its slots and KV-cache blocks, its stop and bad words, a beam
search's beams, and the logits it asked for."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from trtglm.runtime.beams import Beam, BeamSearch, ends_with_any
from trtglm.runtime.request import Handle, KvBlocks, Output, OutputCallback, Request
from trtglm.runtime.sampling import BadWords, held_until_min_tokens, processed


class SequenceState:
    """A request's state while queued and running."""

    def __init__(self, handle: Handle, request: Request, on_output: OutputCallback,
                 is_cancelled: Callable[[], bool] | None):
        self.handle, self.request, self.on_output, self.is_cancelled = handle, request, on_output, is_cancelled
        self.history = [int(t) for t in request.prompt]  # prompt + generated, for word matching
        self.prefilled = 0  # prompt tokens in the slot's cache so far
        self.generated = 0
        self.pending = 0  # tokens chosen on the device whose results have not reached the host yet
        self.slot: int | None = None
        self.scheduled_ns: int | None = None  # when it got its slot, until its first Output carries it
        self.stops_by_last = _by_last_token(request.stop_words)
        self.bad_words = BadWords(request.bad_words)
        self.kv_blocks = 0  # KV-cache blocks reserved for it while it holds a slot
        self.reused_blocks: int | None = None  # prompt blocks found in the prefix cache, once it has a slot
        self._taken: KvBlocks | None = None  # the last blocks_taken (kept while a block holds more positions)
        self.held: list[int] = []  # a beam search's slots besides `slot`
        sampling = request.sampling
        self.beams = BeamSearch(sampling.beam_width, request.max_new_tokens, sampling.length_penalty,
                                sampling.early_stopping, ends_with_any(request.end_id, request.stop_words)) \
            if sampling.beam_width > 1 else None
        self.beam_slots: list[int] = []  # the slot of each running beam
        self.context_rows: list[np.ndarray] | None = [] if request.output.return_context_logits else None  # per chunk
        self.step_logits: np.ndarray | None = None  # the raw logits row of the token being chosen, when asked

    def blocks_taken(self, tokens_per_block: int) -> KvBlocks | None:
        """The blocks its positions take so far (None before it has a slot)."""
        if self.reused_blocks is None:
            return None
        positions = self.prefilled + (self.generated if self.beams is None else self.beams.generated)
        total = self.request.sampling.beam_width * -(-positions // tokens_per_block)
        if self._taken is None or self._taken.total != total:  # every output asks: a new object per block only
            self._taken = KvBlocks(total, self.reused_blocks)
        return self._taken

    @property
    def unprefilled(self) -> int:
        return len(self.request.prompt) - self.prefilled

    def next_chunk(self, length: int) -> list[int]:
        return self.history[self.prefilled:self.prefilled + length]  # history: the prompt, while prefilling

    def wants_cancel(self, ask: bool) -> bool:
        if self.handle.cancelled:
            return True
        if ask and self.is_cancelled is not None:
            try:
                return bool(self.is_cancelled())
            except Exception:  # the request is gone
                return True
        return False

    def banned(self, history: list[int]) -> list[int]:
        """The ids banned after `history` (a beam's: this sequence's and the beam's tokens)."""
        banned = self.bad_words.banned(history)
        if len(history) - len(self.request.prompt) < self.request.sampling.min_tokens:
            banned += held_until_min_tokens(self.request.end_id, self.request.stop_words)
        return banned

    @property
    def host_bound(self) -> bool:
        """Whether choosing its next token needs its last step's results on the host: a beam search, logits asked
        for, bad words longer than one token (banned by the history)."""
        output = self.request.output
        return (self.beams is not None or self.context_rows is not None or output.return_generation_logits
                or bool(self.bad_words.after))

    @property
    def decodes(self) -> bool:
        """Whether its next step takes a decode token: its prompt is in and (a single sequence) its last token is
        not already on the way."""
        return not self.unprefilled and (self.beams is not None or
                                         self.generated + self.pending < self.request.max_new_tokens)

    def decode_rows(self) -> list[tuple[int, int]]:
        """(slot, position) of each decode token this sequence puts into a step: one per running beam. The token is
        the slot's newest (`TokenChooser.last_tokens`), which may still be on the way."""
        if self.beams is None:
            return [(self.slot, len(self.history) - 1 + self.pending)]
        return [(slot, len(self.history) + len(tokens) - 1)
                for slot, tokens in zip(self.beam_slots, self.beams.running, strict=True)]

    def beam_step(self, logits: torch.Tensor, vocab_limit: int) -> list[int]:
        """Advance the beam search by the logits of its beams (`[beams, vocab]`, processed here, ids from
        `vocab_limit` on never chosen); each new beam's parent. Penalties count each beam's own history."""
        request = self.request
        raw = logits.float().cpu().numpy() if request.output.return_generation_logits else None
        histories = [self.history + tokens for tokens in self.beams.running]
        sampling = request.sampling  # beams do not sample: the penalties are not scaled by a temperature
        penalties = (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) \
            if sampling.penalised else None
        rows = processed(logits[:, :vocab_limit], request.embedding_bias, [self.banned(h) for h in histories],
                         penalties, histories)
        return self.beams.step(torch.log_softmax(rows, dim=-1), raw)

    def beam_output(self) -> Output:
        """The finished search's answer: every beam, best first, without its end id (as a single sequence's);
        log probabilities (each token's, and the sum with the end id's) only when asked for."""
        end_id, asked, found, beams = self.request.end_id, self.request.output.return_log_probs, self.beams.result(), []
        for beam in found:
            cut = len(beam.tokens) - (end_id is not None and beam.tokens[-1] == end_id)
            beams.append(Beam(beam.tokens[:cut], beam.cum_log_prob if asked else 0.0, beam.score,
                              beam.log_probs[:cut] if asked else [], beam.logits[:cut]))
        best, ended = beams[0], found[0].tokens
        reason = "end_id" if len(ended) > len(best.tokens) else "stop_word" if self.beams.ends(ended) else "length"
        return Output(best.tokens, best.log_probs, finished=True, reason=reason, beams=beams)

    def stop_word_ends(self) -> bool:
        return any(self.history[-len(w):] == w for w in self.stops_by_last.get(self.history[-1], ()))


def _by_last_token(words: Sequence[Sequence[int]]) -> dict[int, list[list[int]]]:
    table: dict[int, list[list[int]]] = {}
    for word in words:
        if len(word):
            table.setdefault(int(word[-1]), []).append([int(t) for t in word])
    return table
