"""Rendering trtglm's own template checks it against the serving contract (trtglm/backend/contract.py).

Every tensor each model declares (name, data type, dims, optional) and every entry of the
ensemble's steps must be what the contract says for tensorrt_llm's backend, so that the template
and the python models, which take their names from the contract, cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from trtglm.backend.contract import CONTRACT, ENSEMBLE, REPO_MODELS, for_backend, step_reads, step_writes
from trtglm.errors import UsageError
from trtglm.model_repository import CONFIG, parse_config, protobuf


def check_contract(files: Mapping[str, bytes], backend: str, where: str, models=REPO_MODELS) -> None:
    """UsageError listing how the rendered configs (`{model/config.pbtxt: bytes}`) of `models` differ from the
    contract."""
    configs = {model: parse_config(files[f"{model}/{CONFIG}"].decode("utf-8"), f"{where}/{model}/{CONFIG}")
               for model in models}
    problems = contract_problems(configs, backend)
    if problems:
        raise UsageError(f"{where}: does not match trtglm's serving contract (trtglm/backend/contract.py): "
                         f"{'; '.join(problems)}")


def contract_problems(configs: dict, backend: str) -> list[str]:
    """The ways the parsed configs (model -> ModelConfig) differ from the contract; empty when none."""
    problems = []
    for model, expected in CONTRACT.items():
        if model not in configs:
            continue
        for kind in ("input", "output"):
            problems += [f"{model}/config.pbtxt: {p}" for p in
                         _tensor_problems(getattr(configs[model], kind), for_backend(getattr(expected, f"{kind}s"),
                                                                                     backend), kind)]
    for step in configs[ENSEMBLE].ensemble_scheduling.step if ENSEMBLE in configs else ():
        for field, wanted in (("input_map", step_reads), ("output_map", step_writes)):
            found, expected = dict(getattr(step, field)), wanted(step.model_name, backend)
            if found != expected:
                problems.append(f"{ENSEMBLE}/config.pbtxt: step {step.model_name}'s {field} is {sorted(found.items())}"
                                f", the contract says {sorted(expected.items())}")
    return problems


def _tensor_problems(declared, expected, kind: str) -> list[str]:
    data_type = protobuf()[1].DataType.Name
    optional = lambda t: getattr(t, "optional", False)  # noqa: E731  (outputs have no such field)
    found = {t.name: (data_type(t.data_type), tuple(t.dims), optional(t)) for t in declared}
    wanted = {t.name: (t.data_type, t.dims, t.optional) for t in expected}
    problems = [f"{kind} {name} is not in the contract" for name in found if name not in wanted]
    problems += [f"{kind} {name} is missing" for name in wanted if name not in found]
    problems += [f"{kind} {name} is (type, dims, optional) {found[name]}, the contract says {wanted[name]}"
                 for name in wanted if name in found and found[name] != wanted[name]]
    return problems
