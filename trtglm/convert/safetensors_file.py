"""Read and write `.safetensors` files piece by piece, never holding a whole tensor.

The format: an 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded
with spaces to a multiple of 8 bytes, then the tensors' raw little-endian bytes back to back.

`safetensors.save_file` needs every tensor in memory at once, and a memory-mapped reader
keeps every page it touched resident for as long as the file is open. Here the header is
computed up front from the planned shapes, rows are written at their final offsets with
`pwrite` (or copied file to file inside the kernel with `copy_file_range`), and rows are
read with `pread` into a reusable buffer, so memory stays bounded by the block being copied.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from trtglm.errors import ModelFileError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

_LENGTH = struct.Struct("<Q")
# copy_file_range errors meaning "not between these files / not here": fall back to read + write.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a file: dtype, shape and absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def tensor_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file with absolute byte ranges; checks the file is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                raise ModelFileError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = _LENGTH.unpack(head)
            if length > min(_MAX_HEADER, size - _LENGTH.size):
                raise ModelFileError(f"{path}: not a safetensors file (header length {length} exceeds the file)")
            raw = f.read(length)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = _LENGTH.size + length
    header.pop("__metadata__", None)
    return {name: _entry(path, name, spec, data_start, size) for name, spec in header.items()}


def _entry(path: Path, name: str, spec: object, data_start: int, file_size: int) -> TensorEntry:
    try:
        code = spec["dtype"]
        shape = tuple(int(d) for d in spec["shape"])
        begin, end = (int(o) for o in spec["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ModelFileError(f"{path}: corrupt safetensors header entry for {name!r}: {spec!r}") from None
    if code not in DTYPES_BY_CODE:
        raise ModelFileError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
    dtype = DTYPES_BY_CODE[code]
    if end - begin != tensor_bytes(dtype, shape) or begin < 0:
        raise ModelFileError(f"{path}: tensor {name!r} has byte range {begin}..{end}, "
                             f"which does not fit its shape {list(shape)}")
    if data_start + end > file_size:
        raise ModelFileError(f"{path}: truncated ({file_size} bytes; tensor {name!r} ends at byte {data_start + end})")
    return TensorEntry(dtype, shape, data_start + begin, data_start + end)


class KernelCopyUnsupported(OSError):
    """`copy_file_range` cannot copy between these two files."""


class SafetensorsReader:
    """Reads rows of the tensors of one safetensors file with `pread`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = read_header(self.path)
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def byte_range(self, name: str, start: int, stop: int) -> tuple[int, int]:
        """File offset and length of rows [start, stop) of tensor `name`."""
        entry = self.entries[name]
        return entry.begin + start * entry.row_bytes, (stop - start) * entry.row_bytes

    def rows(self, name: str, start: int, stop: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (dim 0; a 0-d tensor has one row).

        Read into `buffer` (uint8, large enough) when given, so repeated reads reuse memory
        instead of faulting in fresh pages; the result then shares memory with `buffer`.
        """
        entry = self.entries[name]
        offset, nbytes = self.byte_range(name, start, stop)
        data = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer[:nbytes]
        _pread_into(self.fd, memoryview(data.numpy()), offset, self.path)
        return data.view(entry.dtype).reshape((stop - start, *entry.shape[1:]) if entry.shape else ())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ModelFileError(f"{path}: truncated while reading (file changed under us?)")
        done += n


class SafetensorsWriter:
    """Writes a safetensors file whose tensors (names, dtypes, shapes, order) are known up front.

    The header and the file size are fixed at creation; `write_rows` puts rows at their final
    offset, so tensors can be filled in any order and in pieces. `close` checks that every
    byte was written exactly once.
    """

    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header_bytes, self.entries = layout(tensors, metadata)
        self.size = len(header_bytes) + sum(e.end - e.begin for e in self.entries.values())
        self._written = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self._fd, memoryview(header_bytes), 0)
        os.ftruncate(self._fd, self.size)
        self._header_size = len(header_bytes)

    def write_rows(self, name: str, rows: torch.Tensor, start_row: int = 0) -> int:
        """Write `rows` as rows [start_row, start_row + len(rows)) of tensor `name`; returns bytes."""
        entry = self.entries[name]
        if rows.dtype != entry.dtype or tuple(rows.shape[1:]) != entry.shape[1:]:
            raise RuntimeError(f"{self.path.name}: {name} expects rows of {entry.dtype} {entry.shape[1:]}, "
                               f"got {rows.dtype} {tuple(rows.shape[1:])}")
        data = memoryview(rows.contiguous().reshape(-1).view(torch.uint8).numpy())
        offset = entry.begin + start_row * entry.row_bytes
        if offset + len(data) > entry.end:
            raise RuntimeError(f"{self.path.name}: rows {start_row}+{len(rows)} overflow {name} {entry.shape}")
        _pwrite_all(self._fd, data, offset)
        self._written += len(data)
        return len(data)

    def copy_rows_from(self, name: str, src_fd: int, src_offset: int, nbytes: int, start_row: int = 0) -> int:
        """Copy `nbytes` of file `src_fd` from `src_offset` to rows from `start_row` of tensor `name`.

        The copy stays in the kernel (`copy_file_range`: no user-space buffer). Raises
        KernelCopyUnsupported, having written nothing, where the file systems do not allow it.
        """
        entry = self.entries[name]
        offset = entry.begin + start_row * entry.row_bytes
        if offset + nbytes > entry.end:
            raise RuntimeError(f"{self.path.name}: {nbytes} bytes at row {start_row} overflow {name} {entry.shape}")
        done = 0
        while done < nbytes:
            try:
                n = os.copy_file_range(src_fd, self._fd, nbytes - done, src_offset + done, offset + done)
            except OSError as e:
                if done == 0 and e.errno in _NO_KERNEL_COPY:
                    raise KernelCopyUnsupported(str(e)) from None
                raise
            if n == 0:
                raise ModelFileError(f"source file ended early while copying {name} (changed while converting?)")
            done += n
        self._written += nbytes
        return nbytes

    def close(self) -> None:
        """Close the file; raises if any tensor byte was left unwritten."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        expected = self.size - self._header_size
        if self._written != expected:
            raise RuntimeError(f"{self.path}: wrote {self._written} of {expected} tensor bytes")

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def layout(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
           metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, TensorEntry]]:
    """The padded header bytes and each tensor's absolute byte range, in the given order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    ranges: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, dtype, shape in tensors:
        if name in header:
            raise RuntimeError(f"duplicate tensor name {name}")
        ranges[name] = (offset, offset + tensor_bytes(dtype, shape))
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": list(ranges[name])}
        offset = ranges[name][1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data_start = _LENGTH.size + len(text)
    entries = {name: TensorEntry(dtype, tuple(shape), data_start + ranges[name][0], data_start + ranges[name][1])
               for name, dtype, shape in tensors}
    return _LENGTH.pack(len(text)) + text, entries


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
