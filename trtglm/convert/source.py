"""Row-wise reads from the tensors of an HF checkpoint folder (`*.safetensors` or `*.bin`).

`HFWeights` finds the shards (index file or scan). Safetensors shards are then read with
`pread` (trtglm.convert.safetensors_file) rather than through a memory map, so a conversion
does not accumulate the whole model in its resident memory. `*.bin` shards are read through
`HFWeights` (`torch.load(weights_only=True, mmap=True)`); their mapped pages do count in
the process's RSS (as reclaimable file pages) until the conversion ends.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtglm.chatglm.weights import HFWeights
from trtglm.convert.safetensors_file import SafetensorsReader
from trtglm.errors import ModelFileError


class TensorSource:
    """Names, shapes, dtypes and row ranges of the tensors of one HF checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        self.weights = HFWeights(model_dir)
        self._readers: dict[str, SafetensorsReader] = {}
        if self.weights.suffix == ".safetensors":
            self._readers = _locate(self.weights)
        self._buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def format(self) -> str:
        return self.weights.suffix

    def names(self) -> list[str]:
        return self.weights.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if self._readers:
            return self._readers[name].entries[name].shape
        return tuple(self.weights.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        if self._readers:
            return self._readers[name].entries[name].dtype
        return self.weights.get(name).dtype

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (along dim 0).

        The result may share memory with the next call's: use it (or copy it) before reading again.
        """
        if not self._readers:
            return self.weights.get(name)[start:stop]
        reader = self._readers[name]
        _, nbytes = reader.byte_range(name, start, stop)
        if nbytes > len(self._buffer):
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return reader.rows(name, start, stop, self._buffer)

    def byte_range(self, name: str, start: int, stop: int) -> tuple[int, int, int] | None:
        """(file descriptor, offset, length) of rows [start, stop) of `name`; None for `.bin` shards."""
        if not self._readers:
            return None
        reader = self._readers[name]
        return (reader.fd, *reader.byte_range(name, start, stop))

    def close(self) -> None:
        for reader in set(self._readers.values()):
            reader.close()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _locate(weights: HFWeights) -> dict[str, SafetensorsReader]:
    """Tensor name → the reader of the shard holding it; every indexed name must be found."""
    reader_of: dict[str, SafetensorsReader] = {}
    for path in weights.shard_files():
        reader = SafetensorsReader(path)
        for name in reader.entries:
            reader_of.setdefault(name, reader)
    lost = [name for name in weights.names() if name not in reader_of]
    if lost:
        raise ModelFileError(f"{weights.model_dir}: the weight index names {len(lost)} tensor(s) that no shard holds "
                             f"(first: {lost[0]})")
    return {name: reader_of[name] for name in weights.names()}
