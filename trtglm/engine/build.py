"""`trtglm build-engine`: a YAML profile → an engine folder with its `trtglm.json` manifest.

Layout of the engine folder OUT (default `engines/<profile name>` under the working
directory):

    OUT/checkpoint/             TensorRT-LLM checkpoint written by `convert`
    OUT/checkpoint.source.json  what the checkpoint was made from (fingerprints); reuse test
    OUT/config.json, rank{r}.engine   TensorRT engines (engine `tensorrt` only)
    OUT/tokenizer/              copy of the HF folder's tokenizer files
    OUT/trtglm.json             the manifest, written last (see manifest.py)

The checkpoint is converted only when it is missing or stale: its record must match the HF
files (names, sizes, mtimes, config.json bytes), the conversion settings and trtglm's
version, and the checkpoint's own files must be unchanged. Otherwise it is reused (logged).

Engine `tensorrt` runs `trtllm-build` (needs TensorRT-LLM, as in NVIDIA's
`nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3` containers) into a staging folder
(`OUT/.trtllm-build.tmp-PID`) and checks the engine's config.json and rank files against the
profile there; only then do they replace the engine in OUT, so a rebuild that fails or is
killed leaves the engine already there working (the next run removes what it left). Engine
`torch` is the checkpoint plus the manifest, for trtglm's PyTorch runtime. `trtglm.json` is
removed just before the engine files are replaced and written (temp file + rename) only once
everything is in place, so a folder with a manifest always holds a complete engine.

`--dry-run` prints the commands (shell-quoted) and needs nothing installed; `--target
trtllm-0.7` prints TensorRT-LLM v0.7.1's single-step `examples/chatglm/build.py` command.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trtglm
from trtglm.chatglm.config import ChatGLMConfig
from trtglm.convert.staging import remove_stale
from trtglm.engine.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, Limits, RankMapping, digest, file_listing,
                                    hf_fingerprint, read_manifest, write_json_atomic, write_manifest)
from trtglm.engine.trtllm_cmd import (TRTLLM_BUILD, convert_argv, trtllm07_build_argv,
                                      trtllm_build_argv)
from trtglm.errors import DependencyError, ModelFileError, OutputExistsError, TrtglmError, UsageError
from trtglm.files import read_json_object
from trtglm.profile import ConvertSection, Profile, load_profile

log = logging.getLogger(__name__)

TARGETS = ("current", "trtllm-0.7")
CHECKPOINT = "checkpoint"
CHECKPOINT_RECORD = "checkpoint.source.json"
TOKENIZER = "tokenizer"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
TRTLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3"
DEFAULT_ENGINES = Path("engines")


def build_engine(config: str | Path, *, model_dir: str | Path | None, output_dir: str | Path | None, dry_run: bool,
                 force: bool, target: str, overrides: dict[str, Any]) -> Path | None:
    """Build the engine folder for profile `config`; returns it (None for --dry-run / another target)."""
    if target not in TARGETS:
        raise UsageError(f"--target must be one of {', '.join(TARGETS)}, not {target!r}")
    profile = load_build_profile(config, model_dir, overrides, tensorrt=target == "trtllm-0.7")
    out = Path(output_dir) if output_dir is not None else DEFAULT_ENGINES / profile.name
    hf = _model_dir(profile)
    if target == "trtllm-0.7":
        if profile.build.engine != "tensorrt":
            raise UsageError(f"{profile.path}: --target trtllm-0.7 builds TensorRT engines; build.engine is "
                             f"{profile.build.engine}")
        print(shlex.join(trtllm07_build_argv(profile, str(hf), str(out))))
        return None
    if not force and not dry_run and engine_up_to_date(profile, hf, out):
        log.info("%s is up to date with %s and %s: nothing to do (--force rebuilds it)", out, profile.path, hf)
        return out
    check_engine_output(out, force)
    if dry_run:
        print(dry_run_script(profile, hf, out))
        return None
    return _build(profile, hf, out)


def load_build_profile(config: str | Path, model_dir: str | Path | None, overrides: dict[str, Any],
                       tensorrt: bool) -> Profile:
    """The profile with `--model-dir` (relative to the working directory) applied as `model.dir`, and
    build.engine auto resolved (`tensorrt`: to a TensorRT engine whatever this machine has)."""
    overrides = dict(overrides)
    if model_dir is not None:
        overrides["model.dir"] = str(Path(model_dir).resolve())
    profile = load_profile(config, overrides)
    engine = "tensorrt" if tensorrt and profile.build.engine == "auto" else resolved_engine(profile)
    if engine == "tensorrt" and profile.convert.fp8 and not profile.variant.trtllm_fp8:
        raise UsageError(f"{profile.path}: TensorRT-LLM's ChatGLM support matrix has no FP8 for "
                         f"{profile.model.variant}; build it for trtglm's runtime (build.engine: torch) or without "
                         "convert.fp8")
    return replace(profile, build=replace(profile.build, engine=engine))


def resolved_engine(profile: Profile) -> str:
    """build.engine, `auto` resolved: a TensorRT engine where trtllm-build is on PATH (NVIDIA's container),
    else one for trtglm's PyTorch runtime, which runs on any GPU (or CPU) with PyTorch; the choice is said."""
    if profile.build.engine != "auto":
        return profile.build.engine
    found = shutil.which(TRTLLM_BUILD)
    log.info("%s: build.engine auto → %s", profile.path,
             f"tensorrt ({TRTLLM_BUILD} at {found})" if found else
             f"torch (no {TRTLLM_BUILD} on PATH: trtglm's PyTorch runtime)")
    return "tensorrt" if found else "torch"


def _model_dir(profile: Profile) -> Path:
    if profile.model.dir is None:
        raise UsageError(f"{profile.path}: model.dir is not set; give --model-dir")
    return Path(profile.model.dir)


def _build(profile: Profile, hf: Path, out: Path) -> Path:
    trtllm_build = _find_trtllm_build() if profile.build.engine == "tensorrt" else None
    model_cfg = _read_model_config(profile, hf)
    tokenizer = _read_tokenizer(hf, model_cfg)
    out.mkdir(parents=True, exist_ok=True)
    # The conversion is staged (its checkpoint replaces the old one only once complete), so an engine
    # already here keeps working while it runs, and after an interrupted rebuild; only from here on is
    # the folder in flux, without a manifest until the new one is whole.
    sources = ensure_checkpoint(profile, hf, out)
    engine_files, trtllm_version = [], _installed_trtllm_version()
    with _staged_engine(out) as staging:
        if trtllm_build:
            engine_files, trtllm_version = _run_trtllm_build(profile, trtllm_build, out, staging)
        (out / MANIFEST).unlink(missing_ok=True)
        _remove_engine_files(out)
        for name in engine_files:
            os.replace(staging / name, out / name)
    _copy_tokenizer(hf, out / TOKENIZER)
    manifest = make_manifest(profile, model_cfg, tokenizer, sources, engine_files, trtllm_version)
    path = write_manifest(out, manifest)
    log.info("engine ready: %s (%s engine, tp %d, %s%s); manifest %s", out, profile.build.engine,
             profile.convert.tp_size, profile.convert.dtype, _quantization(profile), path)
    return out


def _quantization(profile: Profile) -> str:
    c = profile.convert
    if c.fp8:
        return ", FP8" + (" with an FP8 KV cache" if c.fp8_kv_cache else "")
    return f", weight-only {c.weight_only}" if c.weight_only else ""


# --- output folder --------------------------------------------------------------------------------


def _is_engine_file(name: str) -> bool:
    return name in (MANIFEST, "config.json") or (name.startswith("rank") and name.endswith(".engine"))


def _is_known(name: str) -> bool:
    """Names `build-engine` writes in an engine folder, with their temporary forms (`.NAME.tmp-PID`, ...)."""
    base = re.sub(r"\.(tmp|old)-\d+$", "", name.lstrip("."))
    return _is_engine_file(base) or base in (CHECKPOINT, CHECKPOINT_RECORD, TOKENIZER, TRTLLM_BUILD)


def check_engine_output(out: Path, force: bool) -> None:
    """An engine in `out` needs --force; a folder of other things is never replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder")
    names = [p.name for p in out.iterdir()]
    unknown = sorted(n for n in names if not _is_known(n))
    if unknown:
        raise OutputExistsError(f"{out} holds {unknown[0]}, which build-engine did not write; "
                                "refusing to use it as an engine folder even with --force")
    if any(_is_engine_file(n) or n == TOKENIZER for n in names) and not force:
        raise OutputExistsError(f"{out} already holds an engine (use --force to replace it)")


def engine_up_to_date(profile: Profile, hf: Path, out: Path) -> bool:
    """Whether OUT holds a complete engine built by this trtglm from this profile and these HF files."""
    try:
        manifest = read_manifest(out)
    except TrtglmError:
        return False
    same_profile = manifest.profile == json.loads(json.dumps(profile.to_dict()))
    return (same_profile and manifest.trtglm_version == trtglm.__version__
            and checkpoint_status(profile, hf, out)[0])


def _remove_engine_files(out: Path) -> None:
    for path in out.iterdir():
        if _is_engine_file(path.name):
            path.unlink()
    shutil.rmtree(out / TOKENIZER, ignore_errors=True)


# --- checkpoint -----------------------------------------------------------------------------------


def convert_settings(profile: Profile) -> dict[str, Any]:
    c = profile.convert
    return {"dtype": c.dtype, "tp_size": c.tp_size, "pp_size": c.pp_size, "weight_only": c.weight_only,
            "chatglm_version": profile.chatglm_version, **_fp8_settings(c)}


def _fp8_settings(c: ConvertSection) -> dict[str, Any]:
    """An FP8 conversion's settings, with its calibration prompts' fingerprint (other prompts: other scales); none
    for others, so that their checkpoints' records stay as they were."""
    if not c.fp8:
        return {}
    prompts = Path(c.calibration_prompts) if c.calibration_prompts else None
    fingerprint = hashlib.sha256(prompts.read_bytes()).hexdigest() if prompts and prompts.is_file() else None
    return {"fp8": True, "fp8_kv_cache": c.fp8_kv_cache, "calibration_prompts": c.calibration_prompts,
            "calibration_prompts_sha256": fingerprint}


def checkpoint_source(profile: Profile, hf: Path) -> dict[str, Any]:
    """What a checkpoint made now from `hf` with the profile's settings would be made from."""
    return {"model_dir": str(hf), "hf_fingerprint": hf_fingerprint(hf), "convert": convert_settings(profile),
            "trtglm_version": trtglm.__version__}


def checkpoint_status(profile: Profile, hf: Path, out: Path) -> tuple[bool, str]:
    """(reusable, why): whether OUT/checkpoint matches the HF files and settings."""
    ckpt = out / CHECKPOINT
    if not (ckpt / "config.json").is_file():
        return False, "no checkpoint yet"
    try:
        record = json.loads((out / CHECKPOINT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, f"no readable {CHECKPOINT_RECORD}"
    if not isinstance(record, dict):
        return False, f"no readable {CHECKPOINT_RECORD}"
    wanted = checkpoint_source(profile, hf)
    for key, what in (("convert", "conversion settings"), ("hf_fingerprint", "HF model files"),
                      ("trtglm_version", "trtglm version")):
        if record.get(key) != wanted[key]:
            return False, f"{what} changed{_change(record.get(key), wanted[key]) if key != 'hf_fingerprint' else ''}"
    if record.get("checkpoint_fingerprint") != digest(file_listing(ckpt)):
        return False, "checkpoint files changed since conversion"
    return True, "up to date"


def _change(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        diffs = [f"{k} {old.get(k)} → {new.get(k)}" for k in new if old.get(k) != new.get(k)]
        return f" ({', '.join(diffs)})" if diffs else ""
    return f" ({old} → {new})"


def ensure_checkpoint(profile: Profile, hf: Path, out: Path) -> dict[str, Any]:
    """Convert into OUT/checkpoint unless a reusable one is there; returns its source record."""
    from trtglm.convert.writer import convert_checkpoint

    ckpt = out / CHECKPOINT
    reusable, why = checkpoint_status(profile, hf, out)
    if reusable:
        log.info("reusing checkpoint %s (up to date with %s and the profile's conversion settings)", ckpt, hf)
        return json.loads((out / CHECKPOINT_RECORD).read_text(encoding="utf-8"))
    log.info("converting %s → %s: %s", hf, ckpt, why)
    (out / CHECKPOINT_RECORD).unlink(missing_ok=True)
    c = profile.convert
    convert_checkpoint(hf, ckpt, dtype=c.dtype, tp_size=c.tp_size, pp_size=c.pp_size, weight_only=c.weight_only,
                       fp8=c.fp8, fp8_kv_cache=c.fp8_kv_cache, calibration_prompts=c.calibration_prompts,
                       chatglm_version=profile.chatglm_version, force=True)
    record = {**checkpoint_source(profile, hf), "checkpoint_fingerprint": digest(file_listing(ckpt))}
    write_json_atomic(out / CHECKPOINT_RECORD, record)
    return record


# --- TensorRT-LLM ---------------------------------------------------------------------------------


def _find_trtllm_build() -> str:
    path = shutil.which(TRTLLM_BUILD)
    if path is None:
        raise DependencyError(f"{TRTLLM_BUILD} not found on PATH (TensorRT-LLM is not installed): build TensorRT "
                              f"engines inside NVIDIA's {TRTLLM_CONTAINER} container, or use build.engine: torch")
    return path


def _installed_trtllm_version() -> str | None:
    try:
        return importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextmanager
def _staged_engine(out: Path) -> Iterator[Path]:
    """A staging folder for trtllm-build's output (`OUT/.trtllm-build.tmp-PID`): the engine already in OUT is
    replaced only once the new one is complete and checked, and a build killed midway leaves it as it was.
    Staging folders of runs that were killed are removed first."""
    remove_stale(out / f".{TRTLLM_BUILD}")
    staging = out / f".{TRTLLM_BUILD}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run_trtllm_build(profile: Profile, executable: str, out: Path, staging: Path) -> tuple[list[str], str | None]:
    argv = trtllm_build_argv(profile, str(out / CHECKPOINT), str(staging))
    log.info("running: %s", shlex.join(argv))
    try:
        result = subprocess.run([executable, *argv[1:]], check=False)
    except OSError as e:
        raise DependencyError(f"cannot run {executable}: {e}") from None
    if result.returncode != 0:
        raise TrtglmError(f"{TRTLLM_BUILD} failed (exit status {result.returncode}); its messages are above")
    return check_trtllm_engine(profile, staging)


def check_trtllm_engine(profile: Profile, out: Path) -> tuple[list[str], str | None]:
    """Check `out` holds the engine the profile asked for; returns (engine files, TensorRT-LLM version)."""
    config_path = out / "config.json"
    config = read_json_object(config_path)
    for key in ("pretrained_config", "build_config"):
        if not isinstance(config.get(key), dict):
            raise ModelFileError(f"{config_path}: no {key} (not a TensorRT-LLM engine config)")
    mapping = config["pretrained_config"].get("mapping", {})
    built = (mapping.get("tp_size", 1), mapping.get("pp_size", 1))
    if built != (profile.convert.tp_size, profile.convert.pp_size):
        raise ModelFileError(f"{config_path}: engine mapping tp {built[0]} × pp {built[1]} does not match the "
                             f"profile's tp {profile.convert.tp_size} × pp {profile.convert.pp_size}")
    engines = [f"rank{r}.engine" for r in range(profile.world_size)]
    missing = [name for name in engines if not (out / name).is_file()]
    if missing:
        raise ModelFileError(f"{out}: {TRTLLM_BUILD} did not write {', '.join(missing)}")
    build_config = config["build_config"]
    wrong = [f"{key} {build_config.get(key)} (profile: {value})"
             for key, value in asdict(Limits.of(profile.build)).items() if build_config.get(key) != value]
    if wrong:
        raise ModelFileError(f"{config_path}: engine limits differ from the profile: {', '.join(wrong)}")
    version = config.get("version")
    return ["config.json", *engines], str(version) if version is not None else _installed_trtllm_version()


# --- inputs and manifest --------------------------------------------------------------------------


def _read_model_config(profile: Profile, hf: Path) -> ChatGLMConfig:
    if not hf.is_dir():
        raise ModelFileError(f"{hf}: model folder not found (model.dir in {profile.path}, or --model-dir)")
    cfg = ChatGLMConfig.from_model_dir(hf, version=profile.chatglm_version)
    if profile.variant.six_b_shapes and (cfg.num_layers, cfg.hidden_size) != (28, 4096):
        log.warning("%s: model.variant is %s, but %s has %d layers of width %d (not a 6B model)", profile.path,
                    profile.model.variant, hf, cfg.num_layers, cfg.hidden_size)
    return cfg


def _read_tokenizer(hf: Path, cfg: ChatGLMConfig) -> dict:
    from trtglm.chatglm.chat import tokenizer_facts

    facts = tokenizer_facts(hf)
    if facts["vocab_size"] > cfg.vocab_size:
        raise ModelFileError(f"{hf}: the tokenizer has {facts['vocab_size']} ids but the model only "
                             f"{cfg.vocab_size} embedding rows")
    return facts


def _copy_tokenizer(hf: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (hf / name).is_file():
            shutil.copy2(hf / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def make_manifest(profile: Profile, cfg: ChatGLMConfig, tokenizer: dict, sources: dict, engine_files: list[str],
                  trtllm_version: str | None) -> dict:
    c = profile.convert
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": profile.name,
        "engine": profile.build.engine,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "trtglm_version": trtglm.__version__,
        "tensorrt_llm_version": trtllm_version,
        "mapping": RankMapping(c.tp_size, c.pp_size).to_json(),
        "dtype": c.dtype,
        "quantization": {"weight_only": c.weight_only, "quant_algo": profile.quant_algo,
                         "kv_cache_quant_algo": profile.kv_cache_quant_algo},
        "limits": asdict(Limits.of(profile.build)),
        "checkpoint_dir": CHECKPOINT,
        "engine_files": engine_files,
        "tokenizer_dir": TOKENIZER,
        "tokenizer": tokenizer,
        "model": {"variant": profile.model.variant, "chatglm_version": cfg.version, "num_layers": cfg.num_layers,
                  "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "ffn_hidden_size": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
                  "seq_length": cfg.seq_length, "rope_ratio": cfg.rope_ratio, "rotary_base": cfg.rotary_base},
        "sources": sources,
        "profile_path": str(Path(profile.path).resolve()),
        "profile": profile.to_dict(),
    }


# --- dry run --------------------------------------------------------------------------------------


def dry_run_script(profile: Profile, hf: Path, out: Path) -> str:
    """The commands a build would run, shell-quoted, with `#` comments for what is not a command."""
    reusable, why = checkpoint_status(profile, hf, out)
    ckpt = out / CHECKPOINT
    lines = [f"# profile {profile.path}: {profile.build.engine} engine → {out}"]
    if reusable:
        lines.append(f"# checkpoint {ckpt} is up to date: reused, not converted")
    else:
        lines += [f"# checkpoint: {why}", shlex.join(convert_argv(profile, str(hf), str(ckpt)))]
    if profile.build.engine == "tensorrt":
        lines.append(shlex.join(trtllm_build_argv(profile, str(ckpt), str(out))))
    check = "check the engine against the profile, " if profile.build.engine == "tensorrt" else ""
    lines.append(f"# then: {check}copy the tokenizer to {out / TOKENIZER}, write {out / MANIFEST}")
    return "\n".join(lines)
