"""A sequence's stop rule alone: the end id, stop words and the output budget, by TensorRT-LLM's rules (the end id is
not returned, a stop word is)."""

from __future__ import annotations

from trtglm.runtime.request import Handle, Request
from trtglm.runtime.sequence import SequenceState

END_ID = 2


def taken(tokens: list[int], max_tokens: int = 8, stop_words=()) -> tuple[list[str | None], list[int]]:
    """The reason each of `tokens` gives, and the tokens the sequence kept."""
    sequence = SequenceState(Handle(0), Request([10, 11], max_tokens, end_id=END_ID, stop_words=stop_words),
                             lambda output: None)
    reasons = [sequence.take(token) for token in tokens]
    return reasons, sequence.history[2:]


def test_the_end_id_ends_and_is_not_kept():
    assert taken([5, END_ID]) == ([None, "end_id"], [5])


def test_a_stop_word_ends_once_its_last_token_completes_it_and_is_kept():
    assert taken([5, 6, 5, 7], stop_words=[[5, 7], [9]]) == ([None, None, None, "stop_word"], [5, 6, 5, 7])
    assert taken([9], stop_words=[[5, 7], [9]]) == (["stop_word"], [9])
    assert taken([7], stop_words=[[5, 7]]) == ([None], [7])  # its last token alone is not the word


def test_the_output_budget_ends_at_its_last_token():
    assert taken([5, 6, 7], max_tokens=3) == ([None, None, "length"], [5, 6, 7])


def test_a_stop_word_on_the_last_token_of_the_budget_is_the_reason():
    assert taken([5, 9], max_tokens=2, stop_words=[[9]]) == ([None, "stop_word"], [5, 9])
