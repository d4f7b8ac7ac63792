"""The serving contract (trtglm/backend/contract.py) against the rendered template: every tensor each
config.pbtxt declares, the ensemble's steps, the BLS model's mapping of the same steps and the python
models' input names all agree with the table; a template that drifts from it is refused at render time."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2

from support.cli_calls import patch_repo
from support.repos import make_engine, read_configs, template_copy
from trtglm.backend import bls, contract, llm_requests, postprocessing, preprocessing
from trtglm.backend.contract import (BLS, CONTRACT, ENSEMBLE, POSTPROCESSING, PREPROCESSING, PYTHON, TENSORRT_LLM,
                                     TENSORRTLLM)
from trtglm.errors import UsageError
from trtglm.repo.contract_text import with_declarations

ENGINE_KINDS = {PYTHON: "torch", TENSORRTLLM: "tensorrt"}  # tensorrt_llm's backend -> engine kind


@pytest.fixture(scope="module", params=[PYTHON, TENSORRTLLM])
def rendered(request, tmp_path_factory, fixture_dir):
    """(backend, model -> ModelConfig) of trtglm's template rendered for an engine served by that backend."""
    root = tmp_path_factory.mktemp(request.param)
    engine = make_engine(root, ENGINE_KINDS[request.param], fixture_dir)
    template = template_copy(root) if request.param == PYTHON else None
    return request.param, read_configs(patch_repo(engine, None, root / "repo", template=template))


def declared(tensors) -> dict[str, tuple]:
    type_name = model_config_pb2.DataType.Name
    return {t.name: (type_name(t.data_type), tuple(t.dims), getattr(t, "optional", False)) for t in tensors}


def in_contract(tensors, backend: str) -> dict[str, tuple]:
    return {t.name: (t.data_type, t.dims, t.optional) for t in tensors if t.backend in (None, backend)}


@pytest.mark.parametrize("model", list(CONTRACT))
def test_every_declared_tensor_is_the_contracts(rendered, model):
    backend, configs = rendered
    assert declared(configs[model].input) == in_contract(CONTRACT[model].inputs, backend)
    assert declared(configs[model].output) == in_contract(CONTRACT[model].outputs, backend)


def test_the_python_backend_declares_the_streaming_tensors_and_nvidias_does_not(rendered):
    backend, configs = rendered
    streaming = {"generated_ids", "is_final"} <= {t.name for t in configs[TENSORRT_LLM].output}
    assert streaming == (backend == PYTHON)


def test_the_ensembles_steps_are_the_contracts_wiring(rendered):
    backend, configs = rendered
    steps = configs[ENSEMBLE].ensemble_scheduling.step
    assert [s.model_name for s in steps] == [PREPROCESSING, TENSORRT_LLM, POSTPROCESSING]
    for step in steps:
        wires = [w for w in contract.ENSEMBLE_WIRING if w.step == step.model_name and w.backend in (None, backend)]
        assert dict(step.input_map) == {w.tensor: w.ensemble_tensor for w in wires if w.reads}
        assert dict(step.output_map) == {w.tensor: w.ensemble_tensor for w in wires if not w.reads}


def joined(configs, source: str, target: str) -> dict[str, str]:
    """From the rendered ensemble itself: `source`'s output (or client input) -> the `target` input it feeds."""
    steps = {s.model_name: s for s in configs[ENSEMBLE].ensemble_scheduling.step}
    if source == ENSEMBLE:
        written = {t.name: t.name for t in configs[ENSEMBLE].input}
    else:
        written = {tensor: name for name, tensor in steps[source].output_map.items()}
    return {written[tensor]: name for name, tensor in steps[target].input_map.items() if tensor in written}


def test_the_bls_model_runs_the_ensembles_steps(rendered):
    backend, configs = rendered
    # The BLS model streams with either backend, so it always sends `stream` to tensorrt_llm, as the
    # ensemble does with trtglm's runtime; with NVIDIA's the ensemble sends it to preprocessing instead, and
    # exclude_input_in_output there too (which refuses false).
    moved = {} if backend == PYTHON else {"stream": "STREAM", "exclude_input_in_output": "EXCLUDE_INPUT_IN_OUTPUT"}
    assert {**bls.TO_PREPROCESSING, **moved} == joined(configs, ENSEMBLE, PREPROCESSING)
    assert bls.PREPROCESSED == joined(configs, PREPROCESSING, TENSORRT_LLM)
    # the inputs that put the prompt before the reply the BLS model applies itself; the ensemble passes the flag
    # to tensorrt_llm, and the text only to trtglm's runtime
    reply_form = {client: llm for llm, client in bls.REPLY_FORM.items()
                  if backend == PYTHON or llm == "exclude_input_in_output"}
    assert {k: v for k, v in bls.PASSED.items() if k != "stream" or backend == PYTHON} | reply_form == joined(
        configs, ENSEMBLE, TENSORRT_LLM)
    # every client input goes somewhere (or is refused when set: NVIDIA's BLS-only image and draft inputs), and
    # both models take the same client tensors besides those
    bls_only = {t.name for t in contract.BLS_ONLY_INPUTS}
    assert set(bls.TO_PREPROCESSING) | set(bls.PASSED) | set(bls.REPLY_FORM.values()) | bls_only == {
        t.name for t in configs[BLS].input}
    bls_inputs = {k: v for k, v in declared(configs[BLS].input).items() if k not in bls_only}
    assert bls_inputs == declared(configs[ENSEMBLE].input)
    assert declared(configs[BLS].output) == declared(configs[ENSEMBLE].output)


def test_the_bls_model_reads_what_either_backend_sends(tmp_path, fixture_dir):
    engine = make_engine(tmp_path, "tensorrt", fixture_dir)
    configs = read_configs(patch_repo(engine, None, tmp_path / "repo"))
    llm_step = next(s for s in configs[ENSEMBLE].ensemble_scheduling.step if s.model_name == TENSORRT_LLM)
    assert set(bls.ENGINE_OUTPUTS) == {t.name for t in configs[TENSORRT_LLM].output}
    client_outputs = {t.name for t in configs[ENSEMBLE].output}
    assert set(bls.LOG_PROBS) == {k for k, v in llm_step.output_map.items() if v in client_outputs}


def test_the_python_models_read_the_inputs_their_configs_declare(rendered):
    backend, configs = rendered
    assert set(preprocessing.INPUTS) == {t.name for t in configs[PREPROCESSING].input}
    llm_inputs = {t.name for t in configs[TENSORRT_LLM].input}  # trtglm's runtime reads these with backend python
    assert set(llm_requests.INPUTS) == llm_inputs if backend == PYTHON else llm_inputs < set(llm_requests.INPUTS)
    assert {t.name for t in configs[POSTPROCESSING].input} <= set(postprocessing.INPUTS)
    client = {t.name for t in configs[ENSEMBLE].input}
    assert set(preprocessing.CLIENT_NAMES.values()) <= client


def test_the_python_models_read_the_parameters_their_configs_set(rendered):
    _, configs = rendered
    for model, parameters in contract.PYTHON_MODEL_PARAMETERS.items():
        assert set(parameters) <= set(configs[model].parameters), model
    assert contract.ENGINE_DIR in configs[TENSORRT_LLM].parameters


@pytest.mark.parametrize("old, new, message", [
    ('{ name: "IS_FINAL", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }',
     '{ name: "IS_FINAL", data_type: TYPE_BOOL, dims: [ 2 ], optional: true }',
     r"postprocessing/config.pbtxt: input IS_FINAL is .*\(2,\).* the contract says .*\(1,\)"),
    ('input_map { key: "PAD_ID", value: "pad_id" }\n', '',
     r"ensemble/config.pbtxt: step preprocessing's input_map .* the contract says"),
    ('{ name: "OUTPUT", data_type: TYPE_STRING', '{ name: "TEXT", data_type: TYPE_STRING',
     r"output TEXT is not in the contract; postprocessing/config.pbtxt: output OUTPUT is missing"),
])
def test_a_template_that_drifts_from_the_contract_is_refused_at_render_time(tmp_path, fixture_dir, old, new, message):
    template = template_copy(tmp_path)
    model = ENSEMBLE if "input_map" in old else POSTPROCESSING
    config = template / model / "config.pbtxt"
    config.write_text(with_declarations(config.read_text(), model))  # a copy that declares its tensors itself
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    engine = make_engine(tmp_path, "torch", fixture_dir)
    with pytest.raises(UsageError, match=message):
        patch_repo(engine, None, tmp_path / "repo", template=template)
    assert not (tmp_path / "repo").exists()
