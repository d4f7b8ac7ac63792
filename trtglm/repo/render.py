"""`trtglm patch-repo`: the Triton model repository for an engine, rendered, checked, written atomically.

The template is trtglm's own (triton_model_repo/) or a copy of NVIDIA's inflight_batcher_llm
(v0.7.1, v0.19.0 or v1.2.1; `patch.py`), recognised by its placeholders (`placeholders.py`). Every
placeholder is filled from the engine's trtglm.json, its profile's serve section and `--set`
(`values.py`); an unknown `--set` key or a placeholder left unfilled is an error naming the
file and the placeholder. trtglm's template declares no tensor itself: each model's tensors (and the
ensemble's steps) are rendered from the serving contract (`contract_text.py`). A line whose comment says
`only with backend X` is kept only when tensorrt_llm's backend is X (the python backend's extra streaming
tensors); the filled configs must match the serving contract (`contract_check.py`).
The result is checked (`validate.check_repo`) in a temporary folder beside the output and
renamed into place only when it has no problems. Rendering is deterministic: the same inputs
give the same bytes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from trtglm.backend.contract import HISTORY_CHAT, REPO_MODELS
from trtglm.chatglm.chat import tokenizer_facts
from trtglm.engine.manifest import Manifest, TokenizerFacts, read_manifest
from trtglm.errors import ModelFileError, OutputExistsError, UsageError
from trtglm.model_repository import CONFIG
from trtglm.repo.contract_check import check_contract
from trtglm.repo.contract_text import with_declarations
from trtglm.repo.patch import patch_upstream
from trtglm.repo.placeholders import (MODELS, PLACEHOLDER, TRTGLM, check_filled, detect_version, fill_text,
                                      split_comment)
from trtglm.repo.validate import check_repo
from trtglm.repo.values import placeholder_values

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "triton_model_repo"
BACKEND_ONLY = re.compile(r"#\s*only with backend (\w+)\s*$")
ADDED_MODELS = (HISTORY_CHAT,)  # trtglm's models beside the pipeline: every repository gets them


def patch_repo(engine_dir: str | Path, tokenizer_dir: str | Path | None, output_repo: str | Path, *,
               template: str | Path | None, sets: Mapping[str, object], force: bool) -> Path:
    """Render `template` (default: trtglm's) for the engine into `output_repo`; returns its path.

    `tokenizer_dir` None means the engine's own tokenizer (trtglm.json). Raises UsageError for
    unknown `sets` keys, unfilled placeholders or a repository with problems, and
    OutputExistsError when `output_repo` exists and `force` is false.
    """
    manifest = read_manifest(engine_dir)
    tokenizer_dir = checked_tokenizer_dir(tokenizer_dir or manifest.tokenizer_dir, manifest)
    template = Path(template).resolve() if template is not None else TEMPLATE_DIR
    out = Path(output_repo).resolve()
    if out.exists() and not force:
        raise OutputExistsError(f"{out} exists (use --force to replace it)")
    if out == template or template in out.parents:
        raise UsageError(f"--output-repo {out} is inside the template {template}")
    version = detect_version(scan_placeholders(template), str(template))
    values = placeholder_values(manifest, tokenizer_dir, version, sets)
    files = render(template, version, values)
    write_checked(files, out, manifest)
    log.info("%s: %s template (%s) rendered for %s engine %s", out, version, template, manifest.engine,
             manifest.engine_dir)
    return out


def checked_tokenizer_dir(path: str | Path, manifest: Manifest) -> str:
    """Absolute tokenizer folder, refused when its ids differ from those the engine was built with."""
    facts = tokenizer_facts(path)
    for key in TokenizerFacts.compared():
        built = getattr(manifest.tokenizer, key)
        if _same(facts[key]) != _same(built):
            raise UsageError(f"tokenizer {path}: {key} is {facts[key]}, but the engine was built with "
                             f"{built} (use the engine's tokenizer: {manifest.tokenizer_dir})")
    return str(Path(path).resolve())


def _same(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def render(template: Path, version: str, values: Mapping[str, str | None]) -> dict[str, bytes]:
    """{relative path: bytes} of the repository (folders implied; every model gets a version folder 1/).

    trtglm's template is filled as it is, model files included; an upstream copy is patched and
    gets trtglm's model files, and trtglm's models beside the pipeline (ADDED_MODELS) from its template.
    """
    backend = values["triton_backend"]
    if version != TRTGLM:
        files = {**patch_upstream(template, version, values), **filled_configs(TEMPLATE_DIR, ADDED_MODELS, values)}
        check_contract(files, backend, str(TEMPLATE_DIR), ADDED_MODELS)
        return {**files, **model_files(TEMPLATE_DIR, backend)}
    files = filled_configs(template, REPO_MODELS, values)
    check_contract(files, backend, str(template), REPO_MODELS)
    return {**files, **model_files(template, backend)}


def filled_configs(template: Path, models, values: Mapping[str, str | None]) -> dict[str, bytes]:
    """{model/config.pbtxt: bytes} of trtglm's template for `models`, every placeholder filled."""
    files = {}
    for model in models:
        path = template / model / CONFIG
        kept = lines_for_backend(with_declarations(path.read_text(encoding="utf-8"), model), values["triton_backend"])
        text = fill_text(kept, values, str(path))
        check_filled(text, str(path))
        files[f"{model}/{CONFIG}"] = text.encode("utf-8")
    return files


def lines_for_backend(text: str, backend: str | None) -> str:
    """`text` without its lines marked `# only with backend X` for another backend X."""
    kept = []
    for line in text.splitlines(keepends=True):
        match = BACKEND_ONLY.search(split_comment(line)[1])
        if match is None or match.group(1) == backend:
            kept.append(line)
    return "".join(kept)


def model_files(template: Path, backend: str | None) -> dict[str, bytes]:
    """The files under each model's 1/ (the thin model.py files); tensorrt_llm's only for the python backend."""
    files = {}
    for model in REPO_MODELS:
        if model == "tensorrt_llm" and backend != "python":
            continue
        version_dir = template / model / "1"
        for path in sorted(version_dir.rglob("*")) if version_dir.is_dir() else []:
            rel = path.relative_to(template)
            if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
                files[rel.as_posix()] = path.read_bytes()
    return files


# --- placeholders --------------------------------------------------------------------------------


def scan_placeholders(template: Path) -> dict[str, frozenset[str]]:
    """model -> placeholders its config.pbtxt carries outside comments (models without one are absent)."""
    if not template.is_dir():
        raise UsageError(f"--template {template}: not a folder")
    found = {}
    for model in MODELS:
        path = template / model / CONFIG
        if path.is_file():
            code = "\n".join(split_comment(line)[0] for line in path.read_text(encoding="utf-8").splitlines())
            found[model] = frozenset(PLACEHOLDER.findall(code))
    return found


# --- writing -------------------------------------------------------------------------------------


def write_checked(files: Mapping[str, bytes], out: Path, manifest: Manifest | None) -> None:
    """Write `files` to a temporary folder beside `out`, check it, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        write_files(files, tmp)
        problems = check_repo(tmp, manifest=manifest)
        if problems:
            raise UsageError(f"{out}: the rendered repository has {len(problems)} problem(s): {'; '.join(problems)}")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_files(files: Mapping[str, bytes], root: Path) -> None:
    for model in MODELS:
        (root / model / "1").mkdir(parents=True, exist_ok=True)
    for rel in sorted(files):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[rel])


def _replace(new: Path, out: Path) -> None:
    if not out.exists():
        new.rename(out)
        return
    if not out.is_dir():
        raise ModelFileError(f"{out} exists and is not a folder")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old)
