"""What `launch` checks before starting anything: the repository, the world size, the ports."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from trtglm.backend.contract import ENGINE_DIR
from trtglm.errors import ModelFileError, UsageError
from trtglm.files import read_json_object
from trtglm.serve.command import LLM_MODEL, Endpoints

MANIFEST = "trtglm.json"


def check_repo(repo: str | Path) -> Path:
    path = Path(repo).expanduser().resolve()
    if not path.is_dir():
        raise ModelFileError(f"model repository {path}: not a folder")
    if not any(path.glob("*/config.pbtxt")):
        raise ModelFileError(f"model repository {path}: no model in it (no */config.pbtxt); render one with "
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


def engine_world_size(repo: Path) -> int | None:
    """tp × pp of the engine that `tensorrt_llm` serves; None when the repository has no such model.

    The engine folder is tensorrt_llm's `gpt_model_path` parameter; its world size comes from
    trtglm.json's mapping or, for an engine built elsewhere, TensorRT-LLM's config.json.
    """
    engine = engine_dir(repo)
    if engine is None:
        return None
    if (engine / MANIFEST).is_file():
        mapping = _json(engine / MANIFEST).get("mapping")
    else:
        mapping = (_json(engine / "config.json").get("pretrained_config") or {}).get("mapping")
    try:
        return int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1))
    except (AttributeError, TypeError, ValueError):
        raise ModelFileError(f"engine {engine}: no tp/pp mapping in {MANIFEST} or config.json") from None


def profile_ports(repo: Path) -> dict[str, int]:
    """The ports the engine's profile names for its server (`serve.http_port`, `grpc_port`, `metrics_port`, as
    build-engine recorded them in trtglm.json), by endpoint; {} for an engine built elsewhere or none."""
    engine = engine_dir(repo)
    if engine is None or not (engine / MANIFEST).is_file():
        return {}
    serve = (_json(engine / MANIFEST).get("profile") or {}).get("serve") or {}
    return {name: serve[f"{name}_port"] for name in ("http", "grpc", "metrics") if f"{name}_port" in serve}


def engine_dir(repo: Path) -> Path | None:
    config_path = repo / LLM_MODEL / "config.pbtxt"
    if not config_path.is_file():
        return None
    config = model_config(config_path)
    value = config.parameters[ENGINE_DIR].string_value if ENGINE_DIR in config.parameters else ""
    if not value or "${" in value:
        raise ModelFileError(f"{config_path}: parameter {ENGINE_DIR} (the engine folder) is not set "
                             "(render the repository with `trtglm patch-repo`)")
    folder = Path(value)
    if not folder.is_dir():
        raise ModelFileError(f"{config_path}: engine folder {folder} does not exist")
    return folder


def model_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not a Triton model configuration ({e})") from None


def _json(path: Path) -> dict:
    return read_json_object(path, f"missing: engine folder {path.parent} has neither {MANIFEST} nor config.json")


def check_ports(endpoints: Endpoints) -> None:
    """Refuse bad, repeated or busy ports (busy: another socket listens on host:port)."""
    ports = endpoints.ports()
    for name, port in ports.items():
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise UsageError(f"--{name}-port must be a port number (1-65535), not {port!r}")
    if len(set(ports.values())) < len(ports):
        raise UsageError(f"{', '.join(f'--{name}-port' for name in ports)} must differ (got {ports})")
    for name, port in ports.items():
        if not port_is_free(endpoints.host, port):
            raise UsageError(f"--{name}-port {port} on {endpoints.host} is in use (pick another port or stop "
                             "what uses it)")


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
