"""`patch-repo`: the Triton model repository for an engine, or the problems of an existing one."""

from __future__ import annotations

import logging
import sys

from trtglm.errors import ModelFileError, UsageError

log = logging.getLogger(__name__)


def patch_repo(engine_dir: str | None = None, tokenizer_dir: str | None = None, output_repo: str | None = None,
               template: str | None = None, set: list[str] = (), force: bool = False, check: str | None = None):
    """Render the Triton model repository for an engine; `--check REPO` lists an existing one's problems.

    --set PLACEHOLDER=VALUE overrides a placeholder (repeat for several).
    --template DIR patches a copy of NVIDIA's inflight_batcher_llm (v0.7.1, v0.19.0 or v1.2.1) instead.
    """
    from trtglm.repo import check_repo
    from trtglm.repo import patch_repo as render
    from trtglm.repo.values import parse_sets

    if check is not None:
        if engine_dir or tokenizer_dir or output_repo or template or set or force:
            raise UsageError("--check REPO takes no other flags")
        problems = check_repo(check)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            raise ModelFileError(f"{check}: {len(problems)} problem(s)")
        log.info("%s: no problems", check)
        return
    if not engine_dir or not output_repo:
        raise UsageError("patch-repo needs --engine-dir and --output-repo (or --check REPO)")
    render(engine_dir, tokenizer_dir, output_repo, template=template, sets=parse_sets(list(set)), force=force)
