"""The streaming safetensors reader and writer against the `safetensors` library itself."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trtglm.convert.safetensors_file import SafetensorsReader, SafetensorsWriter, read_header
from trtglm.errors import ModelFileError

TENSORS = {
    "a.weight": torch.randn(37, 5).to(torch.bfloat16),
    "b.bias": torch.randn(11),
    "c.ids": torch.arange(24, dtype=torch.int8).reshape(2, 3, 4),
    "d.half": torch.randn(300, 7).half(),
}


def test_rows_written_out_of_order_load_with_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    pieces = [(name, start, min(start + 4, t.shape[0]))
              for name, t in TENSORS.items() for start in range(0, t.shape[0], 4)]
    random.Random(0).shuffle(pieces)
    with SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in TENSORS.items()], {"format": "pt"}) as w:
        for name, start, stop in pieces:
            w.write_rows(name, TENSORS[name][start:stop], start)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(TENSORS)
        for name, tensor in TENSORS.items():
            assert torch.equal(f.get_tensor(name), tensor)
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0  # header padded to 8 bytes


def test_kernel_copy_between_files(tmp_path):
    source = tmp_path / "src.safetensors"
    save_file(TENSORS, source)
    reader = SafetensorsReader(source)
    path = tmp_path / "y.safetensors"
    with SafetensorsWriter(path, [("d.half", torch.float16, (100, 7))]) as w:
        w.copy_rows_from("d.half", reader.fd, *reader.byte_range("d.half", 200, 250), start_row=50)
        w.copy_rows_from("d.half", reader.fd, *reader.byte_range("d.half", 0, 50), start_row=0)
    reader.close()
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_tensor("d.half"), torch.cat([TENSORS["d.half"][:50], TENSORS["d.half"][200:250]]))


def test_writer_refuses_to_finish_with_unwritten_bytes(tmp_path):
    writer = SafetensorsWriter(tmp_path / "z.safetensors", [("a", torch.float32, (4, 2))])
    writer.write_rows("a", torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="wrote 24 of 32"):
        writer.close()
    writer = SafetensorsWriter(tmp_path / "z.safetensors", [("a", torch.float32, (4, 2))])
    with pytest.raises(RuntimeError, match="overflow"):
        writer.write_rows("a", torch.zeros(3, 2), 2)
    writer.abort()


def test_reader_reads_rows_of_a_library_written_file(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file(TENSORS, path)
    reader = SafetensorsReader(path)
    assert {n: (e.dtype, e.shape) for n, e in reader.entries.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in TENSORS.items()}
    buffer = torch.empty(1 << 16, dtype=torch.uint8)
    for name, tensor in TENSORS.items():
        assert torch.equal(reader.rows(name, 1, 2), tensor[1:2])
        assert torch.equal(reader.rows(name, 0, tensor.shape[0], buffer), tensor)
    reader.close()


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:-10], "truncated"),
    (lambda b: b[:5], "shorter than 8 bytes"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length"),
    (lambda b: b[:8] + b"[" + b[9:], "corrupt safetensors header"),
])
def test_damaged_files_are_named(tmp_path, damage, message):
    path = tmp_path / "bad.safetensors"
    save_file(TENSORS, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ModelFileError, match=message):
        read_header(path)
