"""The tensorrt_llm model's beam search tensors: beam_width, len_penalty and early_stopping into the executor's
Request, and a beam search's answer as NVIDIA's output tensors ([1, beams, …], shorter beams padded with -1), its
logits included; and why a sequence ended, on its last response (finish_reason)."""

from __future__ import annotations

import numpy as np
import pytest

from trtglm.backend.llm_requests import engine_request, engine_requests
from trtglm.backend.llm_responses import Responder
from trtglm.errors import UsageError
from trtglm.runtime.beams import Beam
from trtglm.runtime.executor import Output


def arrays(batch: int = 1, **scalars) -> dict[str, np.ndarray]:
    dtypes = {"beam_width": np.int32, "len_penalty": np.float32, "streaming": np.bool_, "early_stopping": np.bool_}
    out = {"input_ids": np.array([[5, 6, 7]] * batch, np.int32),
           "request_output_len": np.array([[8]] * batch, np.int32)}
    for name, values in scalars.items():
        out[name] = np.array(values if isinstance(values, list) else [values] * batch, dtypes[name]).reshape(batch, 1)
    return out


def test_beam_requests_carry_the_width_and_the_length_penalty():
    request, streaming = engine_request(arrays(beam_width=4, len_penalty=0.5, early_stopping=False))
    beams = request.sampling
    assert (beams.beam_width, beams.length_penalty, beams.early_stopping, streaming) == (4, 0.5, 0, False)
    plain = engine_request(arrays())[0].sampling
    assert (plain.beam_width, plain.length_penalty, plain.early_stopping) == (1, 1.0, 1)  # TensorRT-LLM's defaults


@pytest.mark.parametrize("inputs, message", [
    (arrays(beam_width=2, streaming=True), "streaming takes beam_width 1, not 2 (as TensorRT-LLM's backend)"),
    (arrays(beam_width=0), "beam_width"),
    (arrays(2, beam_width=[1, 2]), "beam_width must be the same for every sequence of a request"),
])
def test_bad_beam_requests_are_refused_in_one_line(inputs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        engine_requests(inputs, 8)
    assert "\n" not in str(refused.value)


def test_a_beam_search_answers_every_beam_padded():
    sent = []
    reply = Responder(False, lambda arrays, last: sent.append((arrays, last)), lambda message: None)
    beams = [Beam([4, 5, 6], -0.5, -0.2, [-0.1, -0.1, -0.2]), Beam([4, 9], -1.5, -0.9, [-0.1, -1.2])]
    reply(Output([4, 5, 6], [-0.1, -0.1, -0.2], finished=True, reason="end_id", beams=beams))
    (out, last), = sent
    assert last and out["output_ids"].tolist() == [[[4, 5, 6], [4, 9, -1]]]
    assert out["sequence_length"].tolist() == [[3, 2]] and out["output_ids"].dtype == np.int32
    np.testing.assert_allclose(out["cum_log_probs"], [[-0.5, -1.5]])
    np.testing.assert_allclose(out["output_log_probs"], [[[-0.1, -0.1, -0.2], [-0.1, -1.2, -1.0]]])
    assert out["is_final"].tolist() == [[True]]


def test_a_beam_searchs_logits_are_each_beams_rows_padded():
    sent = []
    reply = Responder(False, lambda arrays, last: sent.append(arrays), lambda message: None)
    rows = [np.full(2, value, np.float32) for value in (0.5, 1.5, 2.5)]
    context = np.arange(6, dtype=np.float32).reshape(3, 2)
    reply(Output([4, 5, 6], finished=True, reason="end_id", context_logits=context,
                 beams=[Beam([4, 5, 6], -0.5, -0.2, [], rows), Beam([4, 9], -1.5, -0.9, [], rows[:1] + rows[2:])]))
    assert sent[0]["context_logits"].tolist() == [context.tolist()]
    assert sent[0]["generation_logits"].tolist() == [[[[0.5, 0.5], [1.5, 1.5], [2.5, 2.5]],
                                                      [[0.5, 0.5], [2.5, 2.5], [-1, -1]]]]  # [1, beams, ids, vocab]


@pytest.mark.parametrize("streaming", [False, True])
def test_plain_and_beam_answers_count_their_output_tokens(streaming):
    sent = []
    reply = Responder(streaming, lambda arrays, last: sent.append(arrays), lambda message: sent.append(message))
    reply(Output(tokens=[4, 5], log_probs=[], finished=False, reason=None))
    reply(Output(tokens=[6], log_probs=[], finished=True, reason="length"))
    assert sent[-1]["num_output_tokens"].tolist() == [[3]]
    beams = []
    Responder(False, lambda arrays, last: beams.append(arrays), beams.append)(Output(
        tokens=[], log_probs=[], finished=True, reason="end_id",
        beams=[Beam([1, 2, 3], -1.0, -0.5, []), Beam([1], -2.0, -2.0, [])]))
    assert beams[0]["num_output_tokens"].tolist() == [[3]]  # the longest beam's, as output_ids' width


def test_a_response_that_cannot_be_made_still_ends_the_request_with_an_error():
    failures = []

    def send(arrays, last):
        raise KeyError("no such output")

    reply = Responder(False, send, failures.append)
    with pytest.raises(KeyError):
        reply(Output(tokens=[4], log_probs=[], finished=True, reason="length"))
    assert failures == ["its response could not be made or sent: 'no such output'"]
    reply(Output(tokens=[5], log_probs=[], finished=True, reason="length"))  # a gone reply takes no more
    assert len(failures) == 1


@pytest.mark.parametrize("reason, told", [("end_id", "stop"), ("stop_word", "stop"), ("length", "length")])
def test_the_last_response_tells_why_the_sequence_ended(reason, told):
    sent = []
    reply = Responder(True, lambda arrays, last: sent.append(arrays), sent.append)
    reply(Output(tokens=[4, 5], log_probs=[], finished=False, reason=None))
    reply(Output(tokens=[6] * (reason != "end_id"), log_probs=[], finished=True, reason=reason))
    assert [arrays["finish_reason"].tolist() for arrays in sent] == [[[b""]], [[told.encode()]]]
    beams = []
    Responder(False, lambda arrays, last: beams.append(arrays), beams.append)(Output(
        tokens=[], log_probs=[], finished=True, reason=reason, beams=[Beam([1, 2], -1.0, -0.5, [])]))
    assert beams[0]["finish_reason"].tolist() == [[told.encode()]]
