"""What a repository serves to the API: its model's id (the engine's name), the Triton model that answers, the
tokenizer, the engine's limits and prompt format (the preprocessing model's parameters, read as preprocessing
reads them: contract.Limits), the most choices of one prompt, and whether trtglm's runtime serves tensorrt_llm.

The answering model is `ensemble` when trtglm's python backend serves tensorrt_llm (its postprocessing then
streams exact text, with no BLS instance between), else `tensorrt_llm_bls` (with NVIDIA's backend only the BLS
model streams exact text), else `ensemble`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtglm.backend.contract import BLS, ENSEMBLE, PREPROCESSING, PYTHON, TOKENIZER_DIR, Limits, parameter
from trtglm.model_repository import (engine_backend, engine_slots, has_model, model_config, parameters,
                                     return_sequences_limit, served_name)


@dataclass(frozen=True)
class Served:
    """The model behind the API: its id, the Triton model answering, the tokenizer, the engine's limits and prompt
    format (preprocessing's), and whether its engine is trtglm's runtime (which reports each reply's tokens and why it
    ended)."""

    model_id: str
    triton_model: str
    tokenizer_dir: str
    limits: Limits
    max_return_sequences: int  # the most choices of one prompt (n), as the served models allow
    trtglm_engine: bool = True
    slots: int = 1  # the sequences the engine runs at once


def served_model(repo: Path) -> Served | None:
    """What `repo` serves to the API; None when it has no client-facing model (no BLS, no ensemble)."""
    triton_model = client_model(repo)
    if triton_model is None or not has_model(repo, PREPROCESSING):
        return None
    params = parameters(model_config(repo, PREPROCESSING))
    return Served(model_id=served_name(repo), triton_model=triton_model,
                  tokenizer_dir=parameter(params, TOKENIZER_DIR, PREPROCESSING),
                  limits=Limits.from_parameters(params, PREPROCESSING),
                  max_return_sequences=return_sequences_limit(repo), trtglm_engine=engine_backend(repo) == PYTHON,
                  slots=engine_slots(repo))


def client_model(repo: Path) -> str | None:
    """The Triton model that answers the API (see the module's doc); None when there is none."""
    present = [m for m in (ENSEMBLE, BLS) if has_model(repo, m)]
    if ENSEMBLE in present and engine_backend(repo) == PYTHON:
        return ENSEMBLE
    return BLS if BLS in present else next(iter(present), None)
