"""Read tensors from an HF checkpoint folder one at a time, without loading the whole model.

`*.safetensors` shards are memory-mapped; `*.bin` shards are opened with
`torch.load(weights_only=True, mmap=True)` so no pickled code runs and no shard is copied
into memory. An index file (`*.index.json`) is used when present, otherwise every shard of
one format is scanned.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import torch

from trtglm.errors import ModelFileError

log = logging.getLogger(__name__)

_FORMATS = (  # (shard suffix, index file name)
    (".safetensors", "model.safetensors.index.json"),
    (".bin", "pytorch_model.bin.index.json"),
)


class HFWeights:
    """Name → tensor access over the shards of one HF checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.suffix, self._shard_of = _find_shards(self.model_dir)
        self._open: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self._shard_of)

    def shard_files(self) -> list[Path]:
        return sorted({self.model_dir / s for s in self._shard_of.values()})

    def get(self, name: str) -> torch.Tensor:
        """The tensor called `name` (a view of the mapped file where possible)."""
        if name not in self._shard_of:
            raise ModelFileError(f"{self.model_dir}: tensor {name!r} not found")
        shard = self._shard(self._shard_of[name])
        if self.suffix == ".safetensors":
            return shard.get_tensor(name)
        return shard[name]

    def shape(self, name: str) -> tuple[int, ...]:
        shard = self._shard(self._shard_of[name])
        if self.suffix == ".safetensors":
            return tuple(shard.get_slice(name).get_shape())
        return tuple(shard[name].shape)

    def _shard(self, file_name: str):
        if file_name not in self._open:
            self._open[file_name] = _open_shard(self.model_dir / file_name, self.suffix)
        return self._open[file_name]


def _find_shards(model_dir: Path) -> tuple[str, dict[str, str]]:
    if not model_dir.is_dir():
        raise ModelFileError(f"{model_dir}: model folder not found")
    for suffix, index_name in _FORMATS:
        index = model_dir / index_name
        if index.exists():
            return suffix, _read_index(index)
        shards = sorted(p.name for p in model_dir.glob(f"*{suffix}") if p.is_file())
        if shards:
            return suffix, _scan_shards(model_dir, shards, suffix)
    raise ModelFileError(f"{model_dir}: no *.safetensors or *.bin weight files")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{index}: not a valid weight index ({e})") from None
    for shard in sorted(set(weight_map.values())):
        if not (index.parent / shard).is_file():
            raise ModelFileError(f"{index}: names shard {shard}, which is missing")
    return dict(weight_map)


def _scan_shards(model_dir: Path, shards: list[str], suffix: str) -> dict[str, str]:
    shard_of: dict[str, str] = {}
    for shard in shards:
        opened = _open_shard(model_dir / shard, suffix)
        for name in opened.keys():
            if name in shard_of:
                raise ModelFileError(f"{model_dir}: tensor {name} appears in both {shard_of[name]} and {shard}")
            shard_of[name] = shard
    return shard_of


def _open_shard(path: Path, suffix: str):
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            return safe_open(str(path), framework="pt")
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: file not found") from None
    except (OSError, RuntimeError, ValueError, EOFError, zipfile.BadZipFile, Exception) as e:
        # safetensors raises its own SafetensorError; torch raises UnpicklingError/RuntimeError.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"{path}: cannot read weights ({first_line})") from None
