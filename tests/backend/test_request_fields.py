"""The one table of a request's settings (trtglm/request_config.py REQUEST_FIELDS), end to end: what the API
encodes as the ensemble's inputs, passed on by the contract's wiring to tensorrt_llm's inputs, is what the
`tensorrt_llm` model decodes into the executor's Request; every bound the table gives is checked there, naming the
input that broke it; and the contract declares each setting's inputs with the table's type."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trtglm.backend.contract import CONTRACT, ENSEMBLE, TENSORRT_LLM, TRITON_TYPES, feeds
from trtglm.backend.llm_requests import engine_request
from trtglm.errors import UsageError
from trtglm.request_config import REQUEST_FIELDS, OutputConfig, SamplingConfig, client_inputs

PROMPT = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32)}


def through_the_ensemble(sampling: SamplingConfig, output: OutputConfig, max_tokens: int) -> dict[str, np.ndarray]:
    """tensorrt_llm's input arrays for what the API sends: the client's inputs, renamed as the ensemble's wiring
    passes them on (max_tokens through preprocessing, as REQUEST_OUTPUT_LEN)."""
    sent = client_inputs(sampling, output, max_tokens)
    passed = {**feeds(ENSEMBLE, TENSORRT_LLM), "max_tokens": "request_output_len"}
    return {**PROMPT, **{passed[name]: np.array([[value]], dtype=dtype) for name, (value, dtype) in sent.items()}}


@pytest.mark.parametrize("sampling", [
    SamplingConfig(),
    SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, seed=2**63 + 5, min_tokens=3, repetition_penalty=1.2,
                   presence_penalty=0.5, frequency_penalty=-0.25, length_penalty=0.5),
    SamplingConfig(top_k=1, temperature=0.5, repetition_penalty=1.1),  # greedy by top_k 1, penalties scaled
    SamplingConfig(beam_width=2, length_penalty=2.0),
], ids=["defaults", "every_setting", "greedy_by_top_k", "beams"])
def test_what_the_api_encodes_the_engine_decodes(sampling):
    output = OutputConfig(return_log_probs=True, return_generation_logits=sampling.beam_width == 1)
    request, streaming = engine_request(through_the_ensemble(sampling, output, 12))
    assert request.max_tokens == 12 and not streaming
    assert request.output == output
    decoded = request.sampling
    for field in (f for f in REQUEST_FIELDS if f.config in SamplingConfig.__dataclass_fields__):
        assert getattr(decoded, field.config) == pytest.approx(getattr(sampling, field.config)), field.config


@pytest.mark.parametrize("name, value, message", [
    ("temperature", -0.5, "temperature must be a finite number with temperature >= 0, not -0.5"),
    ("temperature", math.nan, "temperature must be a finite number with temperature >= 0, not nan"),
    ("runtime_top_p", 1.5, "runtime_top_p must be a number with 0 < runtime_top_p <= 1, not 1.5"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number greater than 0, not 0"),
    ("presence_penalty", math.inf, "presence_penalty must be a finite number, not inf"),
    ("len_penalty", -math.inf, "len_penalty must be a finite number, not -inf"),
    ("min_tokens", -1, "min_tokens must be between 0 and 2147483647, not -1"),
    ("request_output_len", 0, "request_output_len must be between 1 and 2147483647, not 0"),
])
def test_the_engine_refuses_a_setting_out_of_its_bounds_by_its_input_name(name, value, message):
    field = next(f for f in REQUEST_FIELDS if name in f.names("engine"))
    arrays = {**PROMPT, "request_output_len": np.array([[4]], np.int32), "runtime_top_k": np.array([[5]], np.int32),
              name: np.array([[value]], dtype=field.dtype)}
    with pytest.raises(UsageError, match=f"^{message}"):
        engine_request(arrays)


def test_top_p_of_zero_or_less_is_unset_as_in_nvidias_backend():
    for top_p in (0.0, -1.0):
        arrays = {**PROMPT, "request_output_len": np.array([[4]], np.int32),
                  "runtime_top_p": np.array([[top_p]], np.float32)}
        assert engine_request(arrays)[0].sampling == SamplingConfig()


@pytest.mark.parametrize("side, model", [("ensemble", ENSEMBLE), ("engine", TENSORRT_LLM)])
def test_the_contract_declares_every_settings_inputs_with_the_tables_type(side, model):
    declared = {t.name: t for t in CONTRACT[model].inputs}
    for field in REQUEST_FIELDS:
        for name in field.names(side):
            assert declared[name].data_type == f"TYPE_{TRITON_TYPES[field.dtype]}", name
            assert declared[name].optional == (not field.required or model == ENSEMBLE), name
