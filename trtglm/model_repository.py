"""A Triton model repository as trtglm reads it, for every caller (launch, the OpenAI API, `patch-repo` and its
check): each model's configuration (config.pbtxt, parsed with Triton's own protobuf, the one parser), its
parameters, the engine folder that `tensorrt_llm` serves (its `gpt_model_path` parameter), what that folder says
of itself (trtglm.json, or TensorRT-LLM's config.json for an engine built elsewhere: the tp/pp mapping, hence the
world size, the engine's name, the ports its profile names) and the backend serving it.
"""

from __future__ import annotations

from pathlib import Path

from trtglm.backend.contract import ENGINE_DIR, MAX_RETURN_SEQUENCES, TENSORRT_LLM
from trtglm.engine.manifest import MANIFEST, read_manifest
from trtglm.errors import DependencyError, ModelFileError, UsageError
from trtglm.files import read_json_object

CONFIG = "config.pbtxt"  # each model's configuration, in its folder
ENGINE_CONFIG = "config.json"  # TensorRT-LLM's description of an engine it built
PORTS = ("http", "grpc", "metrics")  # the server's endpoints whose ports a profile may name (serve.<name>_port)


# --- configurations ------------------------------------------------------------------------------


def protobuf():
    """(google.protobuf.text_format, Triton's model_config_pb2); DependencyError when tritonclient is missing."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise DependencyError("reading Triton model configurations needs tritonclient: "
                              "pip install 'tritonclient[grpc]' (or trtglm[serve])") from None
    return text_format, model_config_pb2


def parse_config(text: str, where: str):
    """A ModelConfig from protobuf text; ModelFileError naming `where`, with the parser's message."""
    text_format, model_config_pb2 = protobuf()
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ModelFileError(f"{where}: does not parse as a Triton model configuration ({e})") from None


def config_path(repo: Path, model: str) -> Path:
    return repo / model / CONFIG


def has_model(repo: Path, model: str) -> bool:
    return config_path(repo, model).is_file()


def read_pbtxt(path: Path):
    """The ModelConfig in the config.pbtxt at `path`."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{path}: does not parse as a Triton model configuration ({e})") from None
    return parse_config(text, str(path))


def model_config(repo: Path, model: str):
    """`model`'s ModelConfig in `repo`."""
    return read_pbtxt(config_path(repo, model))


def parameters(config) -> dict[str, str]:
    """A ModelConfig's `parameters { key: ..., value { string_value: ... } }` as {key: value}."""
    return {key: value.string_value for key, value in config.parameters.items()}


# --- the engine tensorrt_llm serves ----------------------------------------------------------------


def engine_backend(repo: Path) -> str | None:
    """The backend serving tensorrt_llm (python: trtglm's runtime); None without its config."""
    return model_config(repo, TENSORRT_LLM).backend if has_model(repo, TENSORRT_LLM) else None


def return_sequences_limit(repo: Path) -> int:
    """tensorrt_llm's max_return_sequences (the profile's serve.max_return_sequences, which the BLS model's
    repeats)."""
    params = parameters(model_config(repo, TENSORRT_LLM))
    if MAX_RETURN_SEQUENCES not in params:
        raise UsageError(f"{repo}: {TENSORRT_LLM} has no parameter {MAX_RETURN_SEQUENCES} (render the repository "
                         "again with trtglm patch-repo)")
    return int(params[MAX_RETURN_SEQUENCES])


def engine_slots(repo: Path) -> int:
    """How many sequences tensorrt_llm runs at once (its config's max_batch_size, the engine's)."""
    return int(model_config(repo, TENSORRT_LLM).max_batch_size) or 1


def engine_dir(repo: Path) -> Path | None:
    """The engine folder tensorrt_llm serves; None when the repository has no tensorrt_llm model."""
    if not has_model(repo, TENSORRT_LLM):
        return None
    return engine_folder(model_config(repo, TENSORRT_LLM), str(config_path(repo, TENSORRT_LLM)))


def engine_folder(config, where: str) -> Path:
    """The engine folder that tensorrt_llm's ModelConfig names (its gpt_model_path parameter), which must exist;
    `where` names the configuration in errors."""
    value = parameters(config).get(ENGINE_DIR, "")
    if not value or "${" in value:
        raise ModelFileError(f"{where}: parameter {ENGINE_DIR} (the engine folder) is not set "
                             "(render the repository with `trtglm patch-repo`)")
    folder = Path(value)
    if not folder.is_dir():
        raise ModelFileError(f"{where}: engine folder {folder} does not exist")
    return folder


def engine_description(folder: Path) -> tuple[str, dict]:
    """(file name, its JSON object): the engine folder's trtglm.json, else TensorRT-LLM's config.json."""
    name = MANIFEST if (folder / MANIFEST).is_file() else ENGINE_CONFIG
    missing = f"missing: engine folder {folder} has neither {MANIFEST} nor {ENGINE_CONFIG}"
    return name, read_json_object(folder / name, missing)


def described_mapping(name: str, description: dict) -> dict | None:
    """The tp/pp mapping in an engine's description: trtglm.json's, or config.json's pretrained_config's."""
    mapping = description.get("mapping") if name == MANIFEST else \
        (description.get("pretrained_config") or {}).get("mapping")
    return mapping if isinstance(mapping, dict) else None


def engine_world_size(repo: Path) -> int | None:
    """tp × pp of the engine that tensorrt_llm serves; None when the repository has no such model."""
    folder = engine_dir(repo)
    if folder is None:
        return None
    mapping = described_mapping(*engine_description(folder))
    try:
        return int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1))
    except (AttributeError, TypeError, ValueError):  # no mapping, or not numbers
        raise ModelFileError(f"engine {folder}: no tp/pp mapping in {MANIFEST} or {ENGINE_CONFIG}") from None


def profile_ports(repo: Path) -> dict[str, int]:
    """The ports the engine's profile names for its server (serve.http_port, grpc_port, metrics_port, as
    build-engine recorded them in trtglm.json), by endpoint; {} for an engine built elsewhere or none."""
    folder = engine_dir(repo)
    if folder is None or not (folder / MANIFEST).is_file():
        return {}
    _, manifest = engine_description(folder)
    serve = (manifest.get("profile") or {}).get("serve") or {}
    return {port: serve[f"{port}_port"] for port in PORTS if f"{port}_port" in serve}


def served_name(repo: Path) -> str:
    """The name the repository's model is served under: the engine's (trtglm.json), else its folder's, else the
    repository's."""
    folder = engine_dir(repo)
    if folder is None:
        return repo.name
    if (folder / MANIFEST).is_file():
        return read_manifest(folder).name or folder.name
    return folder.name
