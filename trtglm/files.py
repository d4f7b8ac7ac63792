"""Reading the small JSON files every stage writes, with one-line errors."""

from __future__ import annotations

import json
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
