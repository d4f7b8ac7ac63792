"""The fixture's torch engine built as `trtglm build-engine` builds it (configs/tiny.yaml)."""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURE, REPO

from trtglm.engine.build import build_engine

PROFILE = REPO / "configs" / "tiny.yaml"
MAX_NEW = 40  # new tokens per prompt where the rank and engine-process tests compare against the unsplit model


def build_tiny_engine(out: Path, tp: int = 1, **overrides) -> Path:
    """The fixture's torch engine (configs/tiny.yaml) at tensor-parallel size `tp`."""
    return build_engine(PROFILE, model_dir=FIXTURE, output_dir=out,
                        overrides={"convert.tp_size": tp, "serve.world_size": tp, **overrides})
