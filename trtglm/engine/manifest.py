"""`trtglm.json`: the engine folder's manifest, the one file later stages read.

It says what was built (engine kind, tp/pp, dtype, quantization, limits), from what
(fingerprints of the HF files, the conversion settings and the checkpoint), for which
tokenizer (its ids and folder) and by which versions. It is written last and atomically, so
a folder with a `trtglm.json` holds a complete engine.

Fingerprints are cheap: every file's name, size and modification time, plus a hash of the
HF `config.json`; enough to notice a changed model without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trtglm.errors import ModelFileError
from trtglm.files import read_json_object

MANIFEST = "trtglm.json"
FORMAT = "trtglm-engine"
FORMAT_VERSION = 1
ENGINE_KINDS = ("tensorrt", "torch")

# key -> expected type(s); what read_manifest guarantees to callers
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "format_version": int,
    "name": str,
    "engine": str,
    "trtglm_version": str,
    "tensorrt_llm_version": (str, type(None)),
    "mapping": dict,
    "dtype": str,
    "quantization": dict,
    "limits": dict,
    "checkpoint_dir": str,
    "engine_files": list,
    "tokenizer_dir": str,
    "tokenizer": dict,
    "model": dict,
    "sources": dict,
    "profile": dict,
}
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


def read_manifest(engine_dir: str | Path) -> dict:
    """The validated manifest of an engine folder; `checkpoint_dir`/`tokenizer_dir` come back absolute.

    Also adds `engine_dir` (absolute). Raises ModelFileError (one line) when the file is
    missing, not JSON, lacks a key, has a wrong type, or names files that are not there.
    """
    engine_dir = Path(engine_dir).resolve()
    path = engine_dir / MANIFEST
    manifest = read_json_object(path, f"not found (is {engine_dir} an engine folder from `trtglm build-engine`?)")
    _check_fields(manifest, path)
    for key in _PATH_KEYS:
        manifest[key] = str((engine_dir / manifest[key]).resolve())
    manifest["engine_dir"] = str(engine_dir)
    _check_files(manifest, engine_dir, path)
    return manifest


def recorded_serve(manifest: dict) -> dict:
    """The serve section the engine was built with, the keys profiles gained since then at their defaults (an
    engine need not be rebuilt for a serving setting)."""
    from dataclasses import MISSING, fields

    from trtglm.profile import ServeSection

    serve = manifest["profile"].get("serve")
    defaults = {f.name: f.default for f in fields(ServeSection) if f.default is not MISSING}
    return {**defaults, **serve} if isinstance(serve, dict) else {}


def _check_fields(manifest: Any, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    for key, kind in _REQUIRED.items():
        if key not in manifest:
            raise ModelFileError(f"{path}: missing key {key}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ModelFileError(f"{path}: {key} has the wrong type ({type(manifest[key]).__name__})")
    if manifest["format"] != FORMAT or manifest["format_version"] != FORMAT_VERSION:
        raise ModelFileError(f"{path}: format {manifest['format']!r} version {manifest['format_version']} "
                             f"is not {FORMAT!r} version {FORMAT_VERSION} (rebuild with this trtglm)")
    if manifest["engine"] not in ENGINE_KINDS:
        raise ModelFileError(f"{path}: engine must be one of {', '.join(ENGINE_KINDS)}, not {manifest['engine']!r}")
    for section, keys in (("mapping", ("world_size", "tp_size", "pp_size")),
                          ("limits", ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                      "max_beam_width")),
                          ("tokenizer", ("pad_id", "end_id", "stop_ids", "vocab_size", "special_ids"))):
        missing = [k for k in keys if k not in manifest[section]]
        if missing:
            raise ModelFileError(f"{path}: {section} lacks {', '.join(missing)}")


def _check_files(manifest: dict, engine_dir: Path, path: Path) -> None:
    needed = [Path(manifest["checkpoint_dir"]) / "config.json", Path(manifest["tokenizer_dir"])]
    needed += [engine_dir / name for name in manifest["engine_files"]]
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
