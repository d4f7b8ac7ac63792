"""Rank 0's steps to the other ranks of its host, over Unix stream sockets.

Rank 0 writes each step's numbers to every follower's socket and goes on: the kernel holds them until the
follower reads. gloo's broadcast, which carried them before, returns only once every follower has posted its
receive, so rank 0's step waited on the slowest follower's loop (218-381 µs a decode step on an H200 host,
0.9-1.4 ms on a 2-core CPU machine). The ranks of a launch run on one host (`trtglm launch`'s mpirun keeps to
loopback).

Meeting: rank 0 listens in a folder of its own (mode 0700, so only this user can connect), names the socket's
path to the others over the control group (gloo), accepts one connection per follower (each says its rank
first), then removes the folder: the connections stay, nothing is left on disk.
"""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trtglm.errors import UsageError

COUNT = struct.Struct("<q")  # a message's first bytes: how many int64 numbers follow
ACCEPT_S = 120.0  # for every follower to connect (they join the groups first, so they are close behind)
SEND_BUFFER = 4 << 20  # bytes the kernel holds for a follower behind rank 0 before rank 0's send waits


class StepLink:
    """Rank 0's end (`sockets`: one per follower, in rank order) or a follower's (`sockets`: the one to rank 0)."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets

    def send(self, numbers: np.ndarray) -> None:
        message = COUNT.pack(len(numbers)) + np.ascontiguousarray(numbers, dtype="<i8").tobytes()
        for sock in self.sockets:
            sock.sendall(message)

    def receive(self) -> np.ndarray:
        (count,) = COUNT.unpack(read_exactly(self.sockets[0], COUNT.size))
        return np.frombuffer(read_exactly(self.sockets[0], 8 * count), dtype="<i8")

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def read_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        try:
            read = sock.recv_into(view[got:])
        except OSError as e:
            raise RuntimeError(f"the step link broke: {e}") from None
        if read == 0:
            raise RuntimeError("rank 0 closed the step link")  # as gloo reports a peer gone
        got += read
    return data


def connect(rank: int, world_size: int, control: dist.ProcessGroup) -> StepLink:
    """Every rank calls it at once: the link between rank 0 and the others (see the module docstring)."""
    if rank != 0:
        path = _receive_path(control)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise UsageError(f"rank {rank} cannot reach rank 0's step link at {path} ({e.strerror}): the ranks "
                             "must run on one host") from None
        sock.sendall(COUNT.pack(rank))
        return StepLink([sock])
    folder = Path(tempfile.mkdtemp(prefix="trtglm-steps-"))  # mode 0700
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(folder / "s"))
            server.listen(world_size)
            server.settimeout(ACCEPT_S)
            _send_path(str(folder / "s"), control)
            return StepLink(_accept(server, world_size))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _accept(server: socket.socket, world_size: int) -> list[socket.socket]:
    by_rank = {}
    while len(by_rank) < world_size - 1:
        sock, _ = server.accept()
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        (rank,) = COUNT.unpack(read_exactly(sock, COUNT.size))
        if not 0 < rank < world_size or rank in by_rank:
            raise RuntimeError(f"the step link was joined as rank {rank} (expected 1 to {world_size - 1}, once each)")
        by_rank[rank] = sock
    return [by_rank[rank] for rank in sorted(by_rank)]


def _send_path(path: str, control: dist.ProcessGroup) -> None:
    encoded = torch.tensor(list(path.encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([len(encoded)]), 0, group=control)
    dist.broadcast(encoded, 0, group=control)


def _receive_path(control: dist.ProcessGroup) -> str:
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, 0, group=control)
    encoded = torch.zeros(int(length), dtype=torch.uint8)
    dist.broadcast(encoded, 0, group=control)
    return bytes(encoded.tolist()).decode()
