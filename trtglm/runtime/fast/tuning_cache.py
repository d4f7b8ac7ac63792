"""The matmul layouts that start-up tuning chose, kept on disk per GPU and kernel source.

Tuning times every candidate block shape of every matmul shape (kernels.tune), then the
one-row layouts again inside the decode step (FastModel._tune_in_step): about half of a 6B
model's cold start. The result depends only on the GPU, the kernels' source and the
Triton/PyTorch versions, so it is kept in `$XDG_CACHE_HOME/trtglm/tuning/` under a key made of
those (as TensorRT keeps a timing cache); a later start of the same shapes reads it and times
nothing. `TRTGLM_RETUNE=1` ignores the file and writes it anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import triton

from trtglm.runtime.fast import gluon_gemv, kernels

log = logging.getLogger(__name__)

CONFIG_TYPES = {cls.__name__: cls for cls in (kernels.Config, kernels.GemvConfig, kernels.PairConfig,
                                              kernels.MmaConfig)}


def cache_file(device: torch.device) -> Path:
    """This GPU's and this kernel source's file."""
    sources = b"".join(Path(module.__file__).read_bytes() for module in (kernels, gluon_gemv))
    name = torch.cuda.get_device_name(device)
    key = hashlib.sha256(b"|".join([name.encode(), torch.__version__.encode(), triton.__version__.encode(),
                                    sources])).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "trtglm" / "tuning" / f"{name.replace(' ', '-')}-{key}.json"


def restore(device: torch.device) -> bool:
    """Fill kernels.CHOSEN from the file, if there is one (and retuning was not asked for)."""
    path = cache_file(device)
    if os.environ.get("TRTGLM_RETUNE") == "1" or not path.is_file():
        return False
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        chosen = {tuple(entry["key"]): CONFIG_TYPES[entry["type"]](*entry["config"]) for entry in entries}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the tuning cache %s (%s)", path, e)
        return False
    kernels.CHOSEN.update(chosen)
    log.info("matmul layouts of %d shapes from %s", len(chosen), path)
    return True


def save(device: torch.device) -> None:
    """Write kernels.CHOSEN to the file (atomically; a failure only costs the next start its tuning)."""
    path = cache_file(device)
    entries = [{"key": list(key), "type": type(config).__name__, "config": list(config)}
               for key, config in kernels.CHOSEN.items()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries), encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        log.warning("could not write the tuning cache %s (%s)", path, e)
