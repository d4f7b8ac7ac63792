"""Atomic output folders: build in a temporary sibling, rename into place when complete.

A failed or interrupted run removes its temporary folder and leaves any existing output
untouched; `--force` replaces an existing output only once the new one is complete, and
only if the existing folder looks like what would be written there (never an arbitrary
folder given by mistake).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from trtglm.errors import OutputExistsError

log = logging.getLogger(__name__)


def check_output(out: Path, force: bool, looks_replaceable: Callable[[Path], bool], kind: str) -> None:
    """Refuse an existing `out` unless `force` and it looks like a `kind` (or is an empty folder)."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise OutputExistsError(f"{out} already exists (use --force to replace it)")
    if not out.is_dir() or out.is_symlink() or not (_is_empty(out) or looks_replaceable(out)):
        raise OutputExistsError(f"{out} exists and is not a {kind}; refusing to replace it even with --force")


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder of `out`; on success it replaces `out`, on any error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    log.debug("replaced %s", out)


def remove_stale(out: Path) -> None:
    """Clean up after runs killed midway (SIGKILL, a machine gone): their `NAME.tmp-PID` folders are removed,
    and a `NAME.old-PID` (the previous output, moved aside just before the swap) is put back when NAME is
    missing, else removed. Folders of PIDs still running are left alone."""
    for sibling in sorted(out.parent.glob(f"{glob.escape(out.name)}.*-*")):
        match = re.fullmatch(r"\.(tmp|old)-(\d+)", sibling.name[len(out.name):])
        if match is None or not sibling.is_dir() or psutil.pid_exists(int(match.group(2))):
            continue
        if match.group(1) == "old" and not out.exists():
            log.warning("putting back %s, left aside by an interrupted run", out)
            sibling.rename(out)
        else:
            log.info("removing %s, left by an interrupted run", sibling)
            shutil.rmtree(sibling, ignore_errors=True)


def _is_empty(folder: Path) -> bool:
    return not any(folder.iterdir())
