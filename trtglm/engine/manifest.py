"""`trtglm.json`: the engine folder's manifest, the one file later stages read.

It says what was built (engine kind, tp/pp, dtype, quantization, limits), from what
(fingerprints of the HF files, the conversion settings and the checkpoint), for which
tokenizer (its ids and folder) and by which versions. It is written last and atomically, so
a folder with a `trtglm.json` holds a complete engine.

`read_manifest` gives it back checked, as a `Manifest`: its limits (`Limits`), its split over ranks (`RankMapping`:
tp, pp and their product, the world size) and its tokenizer's ids (`TokenizerFacts`) typed, each one's keys its
fields.

Fingerprints are cheap: every file's name, size and modification time, plus a hash of the
HF `config.json`; enough to notice a changed model without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from trtglm.errors import ModelFileError
from trtglm.files import read_json_object

MANIFEST = "trtglm.json"
FORMAT = "trtglm-engine"
FORMAT_VERSION = 1
ENGINE_KINDS = ("tensorrt", "torch")


@dataclass(frozen=True)
class Limits:
    """What the engine was built to hold, under TensorRT-LLM's names (its config.json's `build_config` has them too)."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_beam_width: int

    @classmethod
    def of(cls, build: Any) -> Limits:
        """The limits a profile's build section asks for."""
        return cls(**{f.name: getattr(build, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class RankMapping:
    """How the model is split over ranks: tensor- and pipeline-parallel sizes (TensorRT-LLM's `mapping`)."""

    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def to_json(self) -> dict:
        return {"world_size": self.world_size, **asdict(self)}  # world_size too, as TensorRT-LLM writes it


@dataclass(frozen=True)
class TokenizerFacts:
    """The tokenizer's ids the engine was built with (`chatglm.chat.tokenizer_facts`)."""

    vocab_size: int
    pad_id: int
    end_id: int
    stop_ids: list
    special_ids: dict
    sp_vocab_size: int | None = None
    bos_id: int | None = None

    @classmethod
    def compared(cls) -> list[str]:
        """The facts a tokenizer must share with the engine's to serve it."""
        return [f.name for f in fields(cls) if f.default is MISSING]


@dataclass(frozen=True)
class Manifest:
    """An engine folder's trtglm.json, checked (`read_manifest`); the folders in it are absolute."""

    engine_dir: Path
    name: str
    engine: str  # one of ENGINE_KINDS
    dtype: str
    mapping: RankMapping
    limits: Limits
    tokenizer: TokenizerFacts
    quantization: dict  # weight_only (the profile's), quant_algo and kv_cache_quant_algo (TensorRT-LLM's)
    checkpoint_dir: Path
    tokenizer_dir: Path
    engine_files: list  # beside trtglm.json
    model: dict  # the model's shape
    sources: dict  # what it was built from (fingerprints)
    profile: dict  # the profile it was built from, resolved
    trtglm_version: str
    tensorrt_llm_version: str | None

    @property
    def serve(self) -> dict:
        """The serve section the engine was built with, the keys profiles gained since then at their defaults (an
        engine need not be rebuilt for a serving setting)."""
        from trtglm.profile import ServeSection

        serve = self.profile.get("serve")
        defaults = {f.name: f.default for f in fields(ServeSection) if f.default is not MISSING}
        return {**defaults, **serve} if isinstance(serve, dict) else {}


SECTIONS = {"mapping": RankMapping, "limits": Limits, "tokenizer": TokenizerFacts}  # key -> the type it is read as
_PATH_KEYS = ("checkpoint_dir", "tokenizer_dir")  # stored relative to the engine folder


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(engine_dir: str | Path, manifest: dict) -> Path:
    path = Path(engine_dir) / MANIFEST
    write_json_atomic(path, manifest)
    return path


def read_manifest(engine_dir: str | Path) -> Manifest:
    """The checked manifest of an engine folder. Raises ModelFileError (one line) when the file is missing, not
    JSON, lacks a key, has a wrong type, or names files that are not there."""
    engine_dir = Path(engine_dir).resolve()
    path = engine_dir / MANIFEST
    raw = read_json_object(path, f"not found (is {engine_dir} an engine folder from `trtglm build-engine`?)")
    _check_format(raw, path)
    values = {name: _checked(raw, name, hint, path) for name, hint in typing.get_type_hints(Manifest).items()
              if name != "engine_dir"}
    for key, cls in SECTIONS.items():
        values[key] = cls(**{name: _checked(values[key], name, hint, path, key)
                             for name, hint in typing.get_type_hints(cls).items() if name in values[key]
                             or _required(cls, name)})
    stored_world = raw["mapping"].get("world_size")
    if stored_world is not None and stored_world != values["mapping"].world_size:
        raise ModelFileError(f"{path}: mapping.world_size is {stored_world}, but tp × pp = "
                             f"{values['mapping'].tp_size} × {values['mapping'].pp_size}")
    for key in _PATH_KEYS:
        values[key] = (engine_dir / values[key]).resolve()
    manifest = Manifest(engine_dir=engine_dir, **values)
    _check_files(manifest, path)
    return manifest


def _check_format(raw: dict, path: Path) -> None:
    for key, kind in (("format", str), ("format_version", int)):
        _checked(raw, key, kind, path)
    if raw["format"] != FORMAT or raw["format_version"] != FORMAT_VERSION:
        raise ModelFileError(f"{path}: format {raw['format']!r} version {raw['format_version']} "
                             f"is not {FORMAT!r} version {FORMAT_VERSION} (rebuild with this trtglm)")


def _required(cls: type, name: str) -> bool:
    return next(f for f in fields(cls) if f.name == name).default is MISSING


def _checked(raw: dict, key: str, hint: Any, path: Path, section: str | None = None) -> Any:
    """`raw[key]`, which must be of type `hint` (a Path is stored as a string, a section as an object)."""
    if key not in raw:
        raise ModelFileError(f"{path}: {section} lacks {key}" if section else f"{path}: missing key {key}")
    value, kinds = raw[key], _kinds(hint)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ModelFileError(f"{path}: {f'{section}.' if section else ''}{key} has the wrong type "
                             f"({type(value).__name__})")
    if key == "engine" and section is None and value not in ENGINE_KINDS:
        raise ModelFileError(f"{path}: engine must be one of {', '.join(ENGINE_KINDS)}, not {value!r}")
    return value


def _kinds(hint: Any) -> tuple[type, ...]:
    """The JSON types a field of type `hint` is stored as."""
    if isinstance(hint, types.UnionType):
        return tuple(k for arg in typing.get_args(hint) for k in _kinds(arg))
    return {Path: (str,), type(None): (type(None),)}.get(hint, (dict,) if hint in SECTIONS.values() else (hint,))


def _check_files(manifest: Manifest, path: Path) -> None:
    needed = [manifest.checkpoint_dir / "config.json", manifest.tokenizer_dir]
    needed += [manifest.engine_dir / name for name in manifest.engine_files]
    for file in needed:
        if not file.exists():
            raise ModelFileError(f"{path}: names {file}, which is missing")


# --- fingerprints --------------------------------------------------------------------------------


def file_listing(folder: str | Path, skip: tuple[str, ...] = ()) -> dict[str, list[int]]:
    """{relative path: [size, mtime_ns]} of the regular files under `folder` (hidden ones skipped)."""
    folder = Path(folder)
    listing = {}
    for file in sorted(folder.rglob("*")):
        rel = file.relative_to(folder).as_posix()
        if file.is_file() and not any(part.startswith(".") for part in rel.split("/")) and rel not in skip:
            stat = file.stat()
            listing[rel] = [stat.st_size, stat.st_mtime_ns]
    return listing


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def hf_fingerprint(model_dir: str | Path) -> str:
    """Digest of the HF folder: names, sizes and mtimes of its files plus config.json's bytes."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    config_hash = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return digest({"files": file_listing(model_dir), "config.json": config_hash})
