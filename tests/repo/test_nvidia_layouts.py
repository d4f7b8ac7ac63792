"""Every repository patch-repo writes takes every input and gives every output of NVIDIA's config for its
version, under NVIDIA's names, types, dims and optionality: trtglm's own template (NVIDIA's v0.19.0 and
v1.2.1 tensors both), and copies of NVIDIA's v0.7.1, v0.19.0 and v1.2.1 layouts, patched for an engine of
either backend. Every client input of the ensemble reaches a model (which honours it, or refuses a value it
cannot honour). Only preprocessing's multimodal outputs are left out: trtglm refuses images."""

from __future__ import annotations

import pytest

from support.cli_calls import patch_repo
from support.nvidia import nvidia_configs, v1_2_1_copy
from support.repos import UPSTREAM, make_engine, read_configs
from trtglm.repo.patch import CHECKED_BY_PREPROCESSING

pytestmark = pytest.mark.skipif(not all(path.is_dir() for path in UPSTREAM.values()),
                                reason="NVIDIA's layouts are not here (../shared/upstream)")

MULTIMODAL = {"PIXEL_VALUES", "ASPECT_RATIO_IDS", "ASPECT_RATIO_MASK", "CROSS_ATTENTION_MASK", "IMAGE_SIZES",
              "IS_VIDEO_INPUT", "ATTENTION_MASK", "IMAGE_GRID_THW", "VISION_INPUT_ID"}  # preprocessing outputs
LAYOUTS = {"trtglm": ("v0.19.0", "v1.2.1"), "v0.7.1": ("v0.7.1",), "v0.19.0": ("v0.19.0",),
           "v1.2.1": ("v1.2.1",)}  # template -> NVIDIA versions whose tensors it must have


@pytest.fixture(scope="module")
def nvidia_layouts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("nvidia")
    return {**{version: UPSTREAM[version] for version in ("v0.7.1", "v0.19.0")}, "v1.2.1": v1_2_1_copy(root)}


@pytest.fixture(scope="module", params=[(t, k) for t in LAYOUTS for k in ("torch", "tensorrt")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def patched(request, tmp_path_factory, fixture_dir, nvidia_layouts):
    """(template name, model -> ModelConfig) of the template patched for an engine of that kind."""
    template, kind = request.param
    root = tmp_path_factory.mktemp(f"{template}-{kind}")
    engine = make_engine(root, kind, fixture_dir)
    source = None if template == "trtglm" else nvidia_layouts[template]
    return template, read_configs(patch_repo(engine, None, root / "repo", template=source))


def tensors(tensors) -> dict[str, tuple]:
    return {t.name: (t.data_type, tuple(t.dims), getattr(t, "optional", False)) for t in tensors}


def made_optional(model: str, name: str, spec: tuple) -> tuple | None:
    """What trtglm declares for a required input of NVIDIA's that preprocessing refuses when missing
    (contract.REQUIRED_BY_PREPROCESSING: Triton would end the request with an empty stream)."""
    return (*spec[:2], True) if name in CHECKED_BY_PREPROCESSING.get(model, ()) else None


def test_every_model_has_every_tensor_of_nvidias_config(patched, nvidia_layouts):
    template, configs = patched
    # patch-repo fills encoder_input_features' data type with the engine's dtype (make_engine's float32), and the
    # prompt table's with the FP16 NVIDIA's ensemble passes on; trtglm's template declares NVIDIA's examples' types
    engine_types = {} if template == "trtglm" else {"logits_datatype": "TYPE_FP32",
                                                    "encoder_input_features_data_type": "TYPE_FP32"}
    for version in LAYOUTS[template]:
        nvidia = nvidia_configs(nvidia_layouts[version], engine_types)
        for model, expected in nvidia.items():
            for kind in ("input", "output"):
                have = tensors(getattr(configs[model], kind))
                missing = {name: spec for name, spec in tensors(getattr(expected, kind)).items()
                           if have.get(name) != spec and not (model == "preprocessing" and name in MULTIMODAL)
                           and have.get(name) != made_optional(model, name, spec)}
                assert not missing, (version, model, kind, {name: have.get(name) for name in missing})


def test_every_ensemble_input_reaches_a_model(patched):
    _, configs = patched
    read = {tensor for step in configs["ensemble"].ensemble_scheduling.step for tensor in step.input_map.values()}
    assert {t.name for t in configs["ensemble"].input} <= read


def test_nvidias_v1_2_1_layout_is_recognised_and_filled(tmp_path, fixture_dir, nvidia_layouts):
    engine = make_engine(tmp_path, "torch", fixture_dir)
    configs = read_configs(patch_repo(engine, None, tmp_path / "repo", template=nvidia_layouts["v1.2.1"]))
    table = next(t for t in configs["tensorrt_llm"].input if t.name == "prompt_embedding_table")
    passed_on = next(t for t in configs["ensemble"].input if t.name == "prompt_embedding_table")
    assert table.data_type == passed_on.data_type
    assert "hf_model_path" not in configs["preprocessing"].parameters  # unset: left to the reader's default
