"""Reading the small JSON files every stage writes, with one-line errors; the file through which a starting
engine says which phase of its start it is in (a launch waiting for it shows the phase)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trtglm.errors import ModelFileError


def read_json_object(path: str | Path, missing: str = "file not found") -> dict:
    """The JSON object in `path`; a missing file raises `ModelFileError` with `missing` as the reason."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


PHASE_FILE = "TRTGLM_PHASE_FILE"  # environment: the file a starting engine writes its phase to (launch sets it)


def report_phase(phase: str) -> None:
    """Say in $TRTGLM_PHASE_FILE (if set) that this process's start is now in `phase`."""
    path = os.environ.get(PHASE_FILE)
    if not path:
        return
    try:
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text(json.dumps({"phase": phase, "since": time.time()}), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a phase not shown costs nothing else


def read_phase(path: str | Path) -> tuple[str, float] | None:
    """(phase, seconds in it) as report_phase wrote it, or None."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return str(data["phase"]), max(0.0, time.time() - float(data["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
