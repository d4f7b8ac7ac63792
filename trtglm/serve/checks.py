"""What `launch` checks before starting anything: the repository, the world size, the ports."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from trtglm.errors import ModelFileError, UsageError
from trtglm.model_repository import CONFIG, engine_dir, engine_world_size
from trtglm.serve.command import Endpoints


def repo_folder(repo: str | Path) -> Path:
    path = Path(repo).expanduser().resolve()
    if not path.is_dir():
        raise ModelFileError(f"model repository {path}: not a folder")
    if not any(path.glob(f"*/{CONFIG}")):
        raise ModelFileError(f"model repository {path}: no model in it (no */{CONFIG}); render one with "
                             "`trtglm patch-repo`")
    return path


def resolve_world_size(repo: Path, requested: int | None) -> int:
    """`requested`, checked against the engine's tp × pp; the engine's (or 1) when not given."""
    engine = engine_world_size(repo)
    if requested is None:
        return engine or 1
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise UsageError(f"--world-size must be a whole number ≥ 1, not {requested!r}")
    if engine is not None and requested != engine:
        raise UsageError(f"--world-size {requested} does not match the engine's tp × pp = {engine} "
                         f"({engine_dir(repo)})")
    return requested


def check_ports(endpoints: Endpoints, flag=lambda name: f"--{name}-port") -> None:
    """Refuse bad, repeated or busy ports (busy: another socket listens on host:port); `flag` names a port in
    the error, by its key in `endpoints.ports()`."""
    ports = endpoints.ports()
    for name, port in ports.items():
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise UsageError(f"{flag(name)} must be a port number (1-65535), not {port!r}")
    if len(set(ports.values())) < len(ports):
        raise UsageError(f"{', '.join(map(flag, ports))} must differ (got {ports})")
    for name, port in ports.items():
        host = endpoints.bind_host(name)
        if not port_is_free(host, port):
            raise UsageError(f"{flag(name)} {port} on {host} is in use (pick another port or stop what uses it)")


def port_is_free(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT, as servers do
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"--host {host}: not an address of this machine") from None
            return False
    return True
