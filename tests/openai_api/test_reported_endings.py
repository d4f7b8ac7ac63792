"""The API takes trtglm's engine at its word: a reply's tokens are the count it reports (num_output_tokens), and
why the reply ended is its finish_reason, not a recount against the limit; only a stop string the API cut at, or
a tool call, says otherwise. An engine that reports neither (NVIDIA's) is counted and recounted as before."""

from __future__ import annotations

from trtglm.openai_api.replies import ChoiceText
from trtglm.openai_api.triton import Ask, Piece, triton_inputs
from trtglm.request_config import OutputConfig, SamplingConfig


def reply_of(*pieces: Piece, stops: tuple[str, ...] = (), limit: int = 4) -> ChoiceText:
    reply = ChoiceText(stops=stops, tool_names=(), limit=limit)
    for piece in pieces:
        reply.add(piece)
    return reply


def test_the_engines_count_and_reason_are_taken_as_they_are():
    # the engine stopped at its stop word on the limit's last token: "stop", though the count reached the limit
    stopped = reply_of(Piece("The", 1, (), 2, ""), Piece(" sky", 2, (), 4, "stop"))
    assert (stopped.tokens, stopped.finish_reason(None)) == (4, "stop")
    cut = reply_of(Piece("The sky", 1, (), 3, ""), Piece("", 0, (), 3, "length"), limit=8)
    assert (cut.tokens, cut.finish_reason(None)) == (3, "length")


def test_a_stop_string_or_a_tool_call_outranks_the_engines_reason():
    reply = reply_of(Piece("The sky is blue", 4, (), 4, "length"), stops=("blue",))
    assert reply.text == "The sky is " and reply.finish_reason(None) == "stop"
    assert reply.finish_reason({"name": "f", "parameters": {}}) == "tool_calls"


def test_an_engine_that_reports_nothing_is_counted_by_its_tokens():
    reply = reply_of(Piece("The", 1, ()), Piece(" sky", 1, ()), limit=2)
    assert (reply.tokens, reply.finish_reason(None)) == (2, "length")


def test_the_count_is_asked_for_only_from_an_engine_that_reports():
    ask = Ask([{"role": "user", "content": "hi"}], 8, SamplingConfig(), OutputConfig(), (), True, reported=True)
    assert triton_inputs(ask)["return_num_output_tokens"].tolist() == [[True]]
    assert "return_num_output_tokens" not in triton_inputs(Ask([], 8, SamplingConfig(), OutputConfig(), (), True))
