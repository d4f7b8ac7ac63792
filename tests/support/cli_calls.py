"""Library functions as their `trtglm` command calls them: a keyword a test leaves out gets the command's flag
default, read from the command's signature (the one place those defaults live)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from trtglm.cli import convert as cli_convert
from trtglm.cli import engine as cli_engine
from trtglm.cli import repo as cli_repo
from trtglm.cli.flags import flags_of
from trtglm.convert import synth, writer
from trtglm.engine import build
from trtglm.engine import plan as engine_plan
from trtglm.profile import parse_overrides
from trtglm.repo import render
from trtglm.repo.values import parse_sets


def as_command(fn: Callable, command: Callable, renamed: dict[str, tuple[str, Callable]] | None = None) -> Callable:
    """`fn` with `command`'s flag defaults for the keywords a call leaves out; `renamed`: {flag: (fn's parameter,
    the conversion the command applies)} where the two differ."""
    renamed = renamed or {}
    defaults = {}
    for name, flag in flags_of(command).items():
        parameter, convert = renamed.get(name, (name, lambda value: value))
        if not flag.required and _keyword(fn, parameter):
            defaults[parameter] = convert(flag.default)

    @functools.wraps(fn)
    def call(*args, **given):
        return fn(*args, **{**defaults, **given})

    return call


def _keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` takes `name` by keyword only (or into its **kwargs)."""
    parameters = inspect.signature(fn).parameters
    if name in parameters:
        return parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


SET_OVERRIDES = {"set": ("overrides", lambda pairs: parse_overrides(list(pairs)))}
convert_checkpoint = as_command(writer.convert_checkpoint, cli_convert.convert)
synth_model = as_command(synth.synth_model, cli_convert.synth_model, {"format": ("fmt", str)})
build_engine = as_command(build.build_engine, cli_engine.build_engine, SET_OVERRIDES)
plan = as_command(engine_plan.plan, cli_engine.plan, SET_OVERRIDES)
patch_repo = as_command(render.patch_repo, cli_repo.patch_repo,
                        {"set": ("sets", lambda pairs: parse_sets(list(pairs)))})
