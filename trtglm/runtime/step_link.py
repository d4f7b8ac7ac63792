"""Rank 0's steps to the other ranks, over Unix stream sockets on one host, TCP across hosts.

Rank 0 writes each step's numbers to every follower's socket and goes on: the kernel holds them until the
follower reads. gloo's broadcast, which carried them before, returns only once every follower has posted its
receive, so rank 0's step waited on the slowest follower's loop (218-381 µs a decode step on an H200 host,
0.9-1.4 ms on a 2-core CPU machine).

Meeting, ranks on one host: rank 0 listens in a folder of its own (mode 0700, so only this user can connect), names
the socket's path to the others over the control group (gloo), accepts one connection per follower (each says its
rank first), then removes the folder: the connections stay, nothing is left on disk. Ranks on several hosts
(`trtglm launch --hostfile`): rank 0 listens on a TCP port of its host (`host`, where the ranks met: MASTER_ADDR),
names it and a secret of this meeting over the control group, and takes only connections that say the secret after
their rank; small messages go out at once (TCP_NODELAY).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trtglm.errors import UsageError

log = logging.getLogger(__name__)

COUNT = struct.Struct("<q")  # a message's first bytes: how many int64 numbers follow
ACCEPT_S = 120.0  # for every follower to connect (they join the groups first, so they are close behind)
SEND_BUFFER = 4 << 20  # bytes the kernel holds for a follower behind rank 0 before rank 0's send waits
SECRET_BYTES = 16  # what a follower says after its rank on a TCP link


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


def connect(rank: int, world_size: int, control: dist.ProcessGroup, host: str | None = None) -> StepLink:
    """Every rank calls it at once: the link between rank 0 and the others (see the module docstring); `host`: rank
    0's host when the ranks span hosts (TCP), None on one host (a Unix socket)."""
    if host is not None:
        return _connect_tcp(rank, world_size, control, host)
    if rank != 0:
        path = _receive_text(control)
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
            _broadcast_text(str(folder / "s"), control)
            return StepLink(_accept(server, world_size))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _connect_tcp(rank: int, world_size: int, control: dist.ProcessGroup, host: str) -> StepLink:
    if rank != 0:
        port, secret = _receive_text(control).split(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=ACCEPT_S)
        except OSError as e:
            raise UsageError(f"rank {rank} cannot reach rank 0's step link at {host}:{port} ({e})") from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(COUNT.pack(rank) + bytes.fromhex(secret))
        return StepLink([sock])
    secret = secrets.token_bytes(SECRET_BYTES)
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6) as server:
        server.settimeout(ACCEPT_S)
        port = server.getsockname()[1]
        log.info("rank 0: the steps go to the other hosts' ranks over TCP (%s, port %d)", host, port)
        _broadcast_text(f"{port}:{secret.hex()}", control)
        return StepLink(_accept(server, world_size, secret))


def _accept(server: socket.socket, world_size: int, secret: bytes = b"") -> list[socket.socket]:
    """One connection from each follower, in rank order; with a `secret`, those that do not say it are closed."""
    by_rank = {}
    while len(by_rank) < world_size - 1:
        sock, _ = server.accept()
        sock.settimeout(ACCEPT_S)
        try:
            (rank,) = COUNT.unpack(read_exactly(sock, COUNT.size))
            said = bytes(read_exactly(sock, len(secret)))
        except RuntimeError:
            sock.close()
            continue
        if not hmac.compare_digest(said, secret):
            sock.close()
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not 0 < rank < world_size or rank in by_rank:
            raise RuntimeError(f"the step link was joined as rank {rank} (expected 1 to {world_size - 1}, once each)")
        by_rank[rank] = sock
    return [by_rank[rank] for rank in sorted(by_rank)]


def _broadcast_text(text: str, control: dist.ProcessGroup) -> None:
    encoded = torch.tensor(list(text.encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([len(encoded)]), 0, group=control)
    dist.broadcast(encoded, 0, group=control)


def _receive_text(control: dist.ProcessGroup) -> str:
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, 0, group=control)
    encoded = torch.zeros(int(length), dtype=torch.uint8)
    dist.broadcast(encoded, 0, group=control)
    return bytes(encoded.tolist()).decode()
