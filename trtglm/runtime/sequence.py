"""`SequenceState`: one request's state in the executor (executor.py) from submission to its last `Output`: its
tokens so far, how much of its prompt is prefilled, its slots and KV-cache blocks, the rule that ends it (`take`), a
beam search's beams (beams.py) and the logits it asked for."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from trtglm.runtime.beams import RequestBeams
from trtglm.runtime.request import Handle, KvBlocks, Output, OutputCallback, Request

log = logging.getLogger(__name__)


class SequenceState:
    """A request's state while queued and running."""

    def __init__(self, handle: Handle, request: Request, on_output: OutputCallback,
                 is_cancelled: Callable[[], bool] | None = None):
        self.handle, self.request, self.on_output, self.is_cancelled = handle, request, on_output, is_cancelled
        self.history = [int(t) for t in request.prompt]  # prompt + generated, for word matching
        self.prefilled = 0  # prompt tokens in the slot's cache so far
        self.generated = 0
        self.pending = 0  # tokens chosen on the device whose results have not reached the host yet
        self.slot: int | None = None
        self.scheduled_ns: int | None = None  # when it got its slot, until its first Output carries it
        self.stops_by_last = _by_last_token(request.stop_words)
        self.kv_blocks = 0  # KV-cache blocks reserved for it while it holds a slot
        self.reused_blocks: int | None = None  # prompt blocks found in the prefix cache, once it has a slot
        self._taken: KvBlocks | None = None  # the last blocks_taken (kept while a block holds more positions)
        self.held: list[int] = []  # a beam search's slots besides `slot`
        self.beams = RequestBeams(request) if request.sampling.beam_width > 1 else None
        self.context_rows: list[np.ndarray] | None = [] if request.output.return_context_logits else None  # per chunk
        self.step_logits: np.ndarray | None = None  # the raw logits row of the token being chosen, when asked

    def take(self, token: int) -> str | None:
        """Take the next chosen token; why it ends the sequence, if it does: `end_id` (the token is not kept), `stop_word`
        (it completes one: kept, as TensorRT-LLM returns it) or `length` (the output budget is spent)."""
        if token == self.request.end_id:
            return "end_id"
        self.history.append(token)
        self.generated += 1
        if any(self.history[-len(word):] == word for word in self.stops_by_last.get(token, ())):
            return "stop_word"
        return "length" if self.generated >= self.request.max_tokens else None

    def blocks_taken(self, tokens_per_block: int) -> KvBlocks | None:
        """The blocks its positions take so far (None before it has a slot)."""
        if self.reused_blocks is None:
            return None
        positions = self.prefilled + (self.generated if self.beams is None else self.beams.search.generated)
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

    @property
    def host_bound(self) -> bool:
        """Whether choosing its next token needs its last step's results on the host: a beam search, logits asked
        for, bad words longer than one token (banned by the history)."""
        request = self.request
        return (self.beams is not None or self.context_rows is not None or request.output.return_generation_logits
                or any(len(word) > 1 for word in request.bad_words))

    @property
    def decodes(self) -> bool:
        """Whether its next step takes a decode token: its prompt is in and (a single sequence) its last token is
        not already on the way."""
        return not self.unprefilled and (self.beams is not None or
                                         self.generated + self.pending < self.request.max_tokens)

    def decode_rows(self) -> list[tuple[int, int]]:
        """(slot, position) of each decode token this sequence puts into a step: one per running beam. The token is
        the slot's newest (`TokenChooser.last_tokens`), which may still be on the way."""
        if self.beams is None:
            return [(self.slot, len(self.history) - 1 + self.pending)]
        return self.beams.decode_rows(len(self.history))

    def deliver(self, output: Output, tokens_per_block: int) -> bool:
        """Hand `output` to the request's callback, with what it carries once (when the request got its slot, its
        context logits after its prompt) and its KV-cache blocks; False when that fails (the client is gone)."""
        output.scheduled_ns, self.scheduled_ns = self.scheduled_ns, None
        output.kv_blocks = self.blocks_taken(tokens_per_block)
        if self.context_rows and not self.unprefilled:  # the first output after the prompt carries them
            output.context_logits, self.context_rows = np.concatenate(self.context_rows), []
        try:
            self.on_output(output)
            return True
        except Exception as e:
            log.warning("request %d: could not deliver its output (%s); stopping it", self.handle.id, e)
            return False


def _by_last_token(words: Sequence[Sequence[int]]) -> dict[int, list[list[int]]]:
    table: dict[int, list[list[int]]] = {}
    for word in words:
        if len(word):
            table.setdefault(int(word[-1]), []).append([int(t) for t in word])
    return table
