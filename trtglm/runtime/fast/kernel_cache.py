"""What a GPU start compiles and tunes, kept with the engine: Triton's compiled kernels and the matmul
layouts that tuning chose.

Compiling the kernels and timing every candidate block shape of every matmul (kernels.tune, then the one-row
layouts inside the decode step, FastModel._tune_in_step) is most of a 6B model's cold start. Both depend
only on the GPU model, the kernels' source and the CUDA/PyTorch/Triton versions, so `build-engine` (or
`trtglm warmup`) does it once on the GPU and keeps the result in ENGINE/kernels/KEY/, KEY naming the GPU and
hashing those facts (facts.json beside says them in words):

    ENGINE/kernels/NVIDIA-H100-80GB-HBM3-0123456789abcdef/
        facts.json      the GPU, capability, versions and source hash the key was made of
        triton/         Triton's kernel cache (TRITON_CACHE_DIR while the engine loads)
        tuning.json     the matmul layouts chosen (kernels.CHOSEN)

A start on another GPU model or software finds no folder of its key: it says whose folders the engine holds,
compiles and tunes again, and keeps the result in a folder of its own key, so nothing made for another
machine is used. `$TRTGLM_KERNEL_CACHE` names a folder to use instead (an engine folder that cannot be
written falls back to `$XDG_CACHE_HOME/trtglm/kernels/`); `TRTGLM_RETUNE=1` ignores tuning.json and writes it
anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FOLDER = "kernels"  # in the engine folder
_active: Path | None = None  # the folder this process uses (use())


def machine_facts(device: torch.device) -> dict[str, str]:
    """What compiled kernels and tuned layouts depend on."""
    import triton

    sources = b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}", "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton.__version__,
            "kernel_sources": hashlib.sha256(sources).hexdigest()[:16]}


def machine_key(facts: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9.]+', '-', facts['gpu']).strip('-')}-{digest}"


def use(engine_dir: str | Path, device: torch.device, facts: dict[str, str] | None = None) -> Path:
    """Make this process compile into and tune from the engine's folder for this machine (`facts`, default
    machine_facts(device)) before any kernel compiles; its path. Says when the engine holds only other
    machines' folders."""
    global _active
    facts = facts or machine_facts(device)
    folder = _folder(Path(engine_dir), machine_key(facts))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "facts.json").write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")  # this process and what it starts
    try:
        import triton

        triton.knobs.cache.dir = str(folder / "triton")  # in case Triton read the variable already
    except (ImportError, AttributeError):
        pass  # no Triton (nothing compiles), or one that reads the variable at each compilation
    _active = folder
    if tuned_here(folder):
        log.info("compiled kernels and tuned layouts for this GPU from %s", folder)
    else:
        others = sorted(path.parent.name for path in (Path(engine_dir) / FOLDER).glob("*/tuning.json"))
        why = f"the engine holds them for other GPUs or software only ({', '.join(others)})" if others else \
            "none are kept with the engine yet (`trtglm warmup` or build-engine on this GPU makes them)"
        log.warning("compiling and tuning kernels for %s (minutes): %s; keeping them in %s", facts["gpu"], why,
                    folder)
    return folder


def _folder(engine_dir: Path, name: str) -> Path:
    chosen = os.environ.get("TRTGLM_KERNEL_CACHE")
    if chosen:
        return Path(chosen).expanduser()
    folder = engine_dir / FOLDER / name
    if os.access(folder if folder.exists() else engine_dir, os.W_OK):
        return folder
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtglm" / FOLDER
    log.info("%s cannot be written: keeping compiled kernels in %s", engine_dir, base)
    return base / f"{engine_dir.name}-{name}"


def tuned_here(folder: Path) -> bool:
    return (folder / "tuning.json").is_file()


def tuning_file(device: torch.device) -> Path:
    """The active engine folder's tuning.json; without one (a model loaded outside an engine), a file per
    machine key under $XDG_CACHE_HOME/trtglm/tuning/."""
    if _active is not None:
        return _active / "tuning.json"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "trtglm" / "tuning" / f"{machine_key(machine_facts(device))}.json"


def restore(device: torch.device) -> bool:
    """Fill kernels.CHOSEN from the tuning file, if there is one (and retuning was not asked for)."""
    from trtglm.runtime.fast import kernels

    path = tuning_file(device)
    if os.environ.get("TRTGLM_RETUNE") == "1" or not path.is_file():
        return False
    config_types = {cls.__name__: cls for cls in (kernels.Config, kernels.GemvConfig, kernels.PairConfig,
                                                  kernels.MmaConfig)}
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        chosen = {tuple(entry["key"]): config_types[entry["type"]](*entry["config"]) for entry in entries}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the tuning file %s (%s): tuning again", path, e)
        return False
    kernels.CHOSEN.update(chosen)
    log.info("matmul layouts of %d shapes from %s", len(chosen), path)
    return True


def save(device: torch.device) -> None:
    """Write kernels.CHOSEN to the tuning file (atomically; a failure only costs the next start its tuning)."""
    from trtglm.runtime.fast import kernels

    path = tuning_file(device)
    entries = [{"key": list(key), "type": type(config).__name__, "config": list(config)}
               for key, config in kernels.CHOSEN.items()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries), encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        log.warning("could not write the tuning file %s (%s)", path, e)


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """The names of the Triton kernels compiled in the block (a kernel found in Triton's cache on disk counts too:
    it is loaded, not launched from memory)."""
    from triton.runtime.jit import JITFunction

    compiled: list[str] = []
    original = JITFunction._do_compile

    def counted(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    JITFunction._do_compile = counted
    try:
        yield compiled
    finally:
        JITFunction._do_compile = original
