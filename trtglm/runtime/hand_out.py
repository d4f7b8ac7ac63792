"""`HandOut`, a part of the `Executor` (executor.py): the tokens a launched pass chose, handed to their requests —
each request's `Output`, its end (end id, stop word, length, cancel, error) and the delivery to its callback."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from trtglm.runtime.request import Output
from trtglm.runtime.sampling import Chosen
from trtglm.runtime.sequence import SequenceState

log = logging.getLogger(__name__)


@dataclass
class LaunchedPass:
    """A launched pass: the sequences whose tokens it chose, and the choice on its way to the host."""

    sequences: list[SequenceState]
    chosen: Chosen
    decode_only: bool = False  # it carried no prompt tokens


class HandOut:
    """What the executor does with a chosen token; the state it reads and writes is set up by `Executor.__init__`."""

    def _hand_out(self, launched: LaunchedPass) -> None:
        """The tokens of a launched pass to their requests (those still running); a row whose settings left nothing
        to choose ends its request alone, with the error."""
        tokens, log_probs, errors = launched.chosen.result()
        for sequence, token, log_prob, error in zip(launched.sequences, tokens, log_probs, errors, strict=True):
            sequence.pending -= 1
            if sequence.handle.done.is_set():
                continue  # cancelled, or ended by the token before (this one is never sent)
            if error is not None:
                log.warning("request %d: %s", sequence.handle.id, error)
                self._finish(sequence, Output([], finished=True, reason="error",
                                              error=f"no next token could be chosen: {error}"))
            else:
                self._advance(sequence, token, log_prob)

    def _advance(self, sequence: SequenceState, token: int, log_prob: float) -> None:
        request = sequence.request
        if request.end_id is not None and token == request.end_id:
            self._finish(sequence, Output([], finished=True, reason="end_id"))
            return
        sequence.history.append(token)
        sequence.generated += 1
        self._stats.generated_tokens += 1
        reason = "stop_word" if sequence.stop_word_ends() else \
            "length" if sequence.generated >= request.max_new_tokens else None
        output = Output([token], [log_prob] if request.output.return_log_probs else [], finished=reason is not None,
                        reason=reason,
                        generation_logits=None if sequence.step_logits is None else sequence.step_logits[None])
        if reason is not None:
            self._finish(sequence, output)
        elif not self._deliver(sequence, output):
            self._finish(sequence, Output([], finished=True, reason="cancelled"))

    def _finish(self, sequence: SequenceState, output: Output) -> None:
        self._release(sequence)
        self._stats.finished += 1
        self._stats.cancelled += output.reason == "cancelled"
        self._deliver(sequence, output)
        sequence.handle.done.set()

    def _deliver(self, sequence: SequenceState, output: Output) -> bool:
        """Hand `output` to the request's callback; False when that fails (the client is gone)."""
        output.scheduled_ns, sequence.scheduled_ns = sequence.scheduled_ns, None
        output.kv_blocks = sequence.blocks_taken(self.tokens_per_block)
        if sequence.context_rows and not sequence.unprefilled:  # the first output after the prompt carries them
            output.context_logits, sequence.context_rows = np.concatenate(sequence.context_rows), []
        try:
            sequence.on_output(output)
            return True
        except Exception as e:
            log.warning("request %d: could not deliver its output (%s); stopping it", sequence.handle.id, e)
            return False

