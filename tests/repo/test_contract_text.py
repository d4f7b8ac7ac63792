"""trtglm's template declares its tensors and ensemble steps only through the serving contract
(trtglm/backend/contract.py): every template config.pbtxt holds the contract's marker and no declaration of its
own, and what rendering puts there parses (Triton's own protobuf) to exactly the contract's tensors and steps."""

from __future__ import annotations

import re

import pytest

from trtglm.backend.contract import CONTRACT, ENSEMBLE, PYTHON, REPO_MODELS, TENSORRTLLM, for_backend, step_reads, \
    step_writes
from trtglm.model_repository import parse_config, protobuf
from trtglm.repo.contract_text import MARKER, declarations
from trtglm.repo.render import TEMPLATE_DIR, lines_for_backend

DECLARATION = re.compile(r'^\s*((input|output)\s*[\[{]|\{ name:|(input|output)_map\b|ensemble_scheduling\b)')


@pytest.mark.parametrize("model", REPO_MODELS)
def test_the_template_declares_nothing_but_through_the_contract(model):
    text = (TEMPLATE_DIR / model / "config.pbtxt").read_text(encoding="utf-8")
    assert text.count(MARKER) == 1
    assert [line for line in text.splitlines() if DECLARATION.match(line)] == []


def declared(tensors) -> dict[str, tuple]:
    data_type = protobuf()[1].DataType.Name
    return {t.name: (data_type(t.data_type), tuple(t.dims), getattr(t, "optional", False),
                     t.HasField("reshape") and tuple(t.reshape.shape) == (), getattr(t, "allow_ragged_batch", False))
            for t in tensors}


def wanted(tensors) -> dict[str, tuple]:
    return {t.name: (t.data_type, t.dims, t.optional, t.scalar, t.ragged) for t in tensors}


@pytest.mark.parametrize("backend", [PYTHON, TENSORRTLLM])
@pytest.mark.parametrize("model", REPO_MODELS)
def test_rendered_declarations_are_the_contracts_to_the_last_field(model, backend):
    text = lines_for_backend(declarations(model), backend)
    config = parse_config(f'name: "{model}"\n{text}', model)
    for kind in ("input", "output"):
        tensors = for_backend(getattr(CONTRACT[model], f"{kind}s"), backend)
        assert declared(getattr(config, kind)) == wanted(tensors)
        in_order = [t for t in tensors if t.backend is None] + [t for t in tensors if t.backend is not None]
        assert [t.name for t in getattr(config, kind)] == [t.name for t in in_order]  # a backend's own after
    steps = config.ensemble_scheduling.step
    if model == ENSEMBLE:
        assert [step.model_name for step in steps] == ["preprocessing", "tensorrt_llm", "postprocessing"]
    for step in steps:
        assert (dict(step.input_map), dict(step.output_map), step.model_version) == (
            step_reads(step.model_name, backend), step_writes(step.model_name, backend), -1)
