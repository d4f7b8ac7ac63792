"""The package layering of docs/architecture.md, checked against every import in trtglm/ (module level and
inside functions)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

EVERYTHING = {"errors", "files", "conventions", "ports", "processes", "request_config", "chatglm", "convert",
              "profile", "engine", "runtime", "backend", "model_repository", "repo", "openai_api", "serve", "client",
              "bench", "cli"}
ALLOWED = {
    "errors": set(),
    "conventions": set(),
    "ports": set(),
    "processes": set(),
    "files": {"errors"},
    "request_config": {"errors"},
    "chatglm": {"errors", "files"},
    "convert": {"chatglm", "conventions", "errors", "files", "runtime.calibrate", "runtime.checkpoint", "runtime.quant"},
    "profile": {"chatglm", "errors", "conventions", "ports"},
    "engine": {"chatglm", "convert", "errors", "files", "profile"},
    "runtime": {"chatglm", "errors", "files", "conventions", "request_config"},
    "backend": {"chatglm", "engine", "errors", "files", "conventions", "processes", "request_config", "runtime"},
    "model_repository": {"backend.contract", "engine", "errors", "files"},
    "repo": {"backend.contract", "chatglm", "engine", "errors", "files", "model_repository"},
    "openai_api": {"backend.contract", "chatglm", "errors", "model_repository", "ports", "processes", "request_config"},
    "serve": {"backend.contract", "backend.cpus", "chatglm", "client", "conventions", "engine", "errors", "files",
              "model_repository", "openai_api.served", "ports", "processes", "request_config"},
    "client": {"errors", "ports"},
    "bench": EVERYTHING - {"cli", "bench"},
    "cli": EVERYTHING - {"cli"},
}


def imports_of(path: Path) -> set[str]:
    """trtglm modules `path` imports, as `package` or `package.module` below trtglm."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {".".join(name.split(".")[1:3]) for name in names if name.startswith("trtglm.")}
    return found


def allowed(package: str, target: str) -> bool:
    rules = ALLOWED[package]
    return target.split(".")[0] == package or target.split(".")[0] in rules or target in rules


def test_every_import_follows_the_layering():
    broken = []
    for path in sorted((REPO / "trtglm").rglob("*.py")):
        parts = path.relative_to(REPO / "trtglm").parts
        package = parts[0] if len(parts) > 1 else path.stem
        if package in ("__init__", "__main__"):
            continue
        broken += [f"{path.relative_to(REPO)} imports trtglm.{target}" for target in sorted(imports_of(path))
                   if not allowed(package, target)]
    assert broken == []


def test_the_rules_cover_every_package():
    packages = {p.name if p.is_dir() else p.stem for p in (REPO / "trtglm").iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and not p.stem.startswith("_"))}
    assert packages == set(ALLOWED)


def documented_rules() -> dict[str, set[str]]:
    """The layering table of docs/architecture.md read back as ALLOWED's rules: a row's packages (one or more) and
    what each may import ("nothing", "everything", "everything but `x`", "`x` (its `a.py` and `b.py` only)")."""
    rules = {}
    for line in (REPO / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        packages = [name.removesuffix(".py").removesuffix("/") for name in re.findall(r"`([^`]+)`", cells[0])]
        allowed = set()
        if cells[2].startswith("everything"):
            allowed = EVERYTHING - set(re.findall(r"`(\w+)`", cells[2]))
        elif cells[2] != "nothing":
            for package, modules in re.findall(r"`(\w+)`(?: \(its (.+?) only\))?", cells[2]):
                parts = re.findall(r"`(\w+)\.py`", modules)
                allowed |= {f"{package}.{part}" for part in parts} if parts else {package}
        rules.update({package: allowed - {package} for package in packages})
    return rules


def test_the_architecture_page_states_these_rules():
    assert documented_rules() == ALLOWED


LONGEST_MODULE = 450  # lines
LONGER_MODULES = {  # may be longer: GPU kernels and the fixture-training script
    "trtglm/runtime/fast/kernels.py",
    "trtglm/runtime/fast/gluon_gemv.py",
    "scripts/train_fixture.py",
}


def test_no_module_is_longer_than_the_limit():
    modules = [*(REPO / "trtglm").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]
    lines = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in modules}
    assert {name: count for name, count in lines.items()
            if count > LONGEST_MODULE and name not in LONGER_MODULES} == {}
