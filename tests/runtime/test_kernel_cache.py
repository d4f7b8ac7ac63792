"""Where a GPU start keeps what it compiles and tunes (kernel_cache.py): a folder of the engine per machine key,
another machine's folder never used, and a start without its machine's folder said aloud. The tuning file's
contents (kernels.CHOSEN) need Triton and a GPU: test_fast_runtime covers them there."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from trtglm.runtime.fast import kernel_cache

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
        "kernel_sources": "0123456789abcdef"}
CPU = torch.device("cpu")  # machine_facts is not asked: the facts are given


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_cache, "_active", None)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/nowhere")  # restored after the test: use() sets it
    monkeypatch.delenv("TRTGLM_KERNEL_CACHE", raising=False)


def test_a_machine_gets_a_folder_of_its_key_in_the_engine(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        folder = kernel_cache.use(tmp_path, CPU, H100)
    assert folder.parent == tmp_path / "kernels" and folder.name.startswith("NVIDIA-H100-80GB-HBM3-")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert json.loads((folder / "facts.json").read_text()) == H100
    assert kernel_cache.tuning_file(CPU) == folder / "tuning.json"
    assert "none are kept with the engine yet" in caplog.text


@pytest.mark.parametrize("changed", ["gpu", "capability", "torch", "cuda", "triton", "kernel_sources"])
def test_another_gpu_or_software_never_uses_the_folder(tmp_path, caplog, changed):
    first = kernel_cache.use(tmp_path, CPU, H100)
    (first / "tuning.json").write_text("[]")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = kernel_cache.use(tmp_path, CPU, H100)
    assert again == first and "compiling and tuning" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        other = kernel_cache.use(tmp_path, CPU, {**H100, changed: H100[changed] + "x"})
    assert other != first and other.parent == first.parent
    assert f"for other GPUs or software only ({first.name})" in caplog.text
    assert kernel_cache.tuning_file(CPU) == other / "tuning.json" and not (other / "tuning.json").exists()


def test_a_folder_named_by_the_environment_is_used_instead(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTGLM_KERNEL_CACHE", str(tmp_path / "mine"))
    assert kernel_cache.use(tmp_path / "engine", CPU, H100) == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine" / "triton")
