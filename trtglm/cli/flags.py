"""Flags from a command function's signature: each parameter is one `--flag`, its type hint says
what the flag takes, its default makes it optional.

Hints: `str`, `int`, `float`, `bool`, `Path`, `X | None`, `Literal[...]` (choices; `fp16`, `bf16`
and `fp32` also name float16, bfloat16 and float32), `list[str]` (a flag that may repeat), and
`Annotated[T, ...]` with `POSITIVE` or `NOT_NEGATIVE` (number bounds), `Env("NAME")` (the value
when the flag is left out) or `PASSTHROUGH` (the words after `--`). A flag's older name (HIDDEN_FLAGS) is taken
too, and not shown. `check_argv` turns a command
line into one `--name=value` word per flag, refusing what does not fit in one line (exit 2);
fire then calls the function, parsing each value with `Flag.convert` (`fire_parse_fns`).
"""

from __future__ import annotations

import inspect
import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

from trtglm.errors import UsageError

POSITIVE = "positive"
NOT_NEGATIVE = "not negative"
PASSTHROUGH = "passthrough"
ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
HIDDEN_FLAGS = {"max_new_tokens": "max_tokens"}  # older flag names still taken where the newer is a flag; not in help
BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
PosInt = Annotated[int, POSITIVE]
CountInt = Annotated[int, NOT_NEGATIVE]
PosFloat = Annotated[float, POSITIVE]
Passthrough = Annotated[list[str], PASSTHROUGH]


@dataclass(frozen=True)
class Env:
    """The environment variable a flag falls back to."""

    name: str


@dataclass(frozen=True)
class Flag:
    name: str  # the parameter's name
    kind: type  # str, int, float, bool, Path or list (repeated str)
    default: object  # inspect.Parameter.empty: required
    choices: tuple = ()
    bound: str | None = None  # POSITIVE or NOT_NEGATIVE
    env: str | None = None
    passthrough: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    def convert(self, text: str):
        """The value of `text` typed on the command line, or a UsageError saying what was expected."""
        if self.kind is list:
            return json.loads(text)  # check_argv's encoding of the repeated or passed-through words
        if self.choices:
            return self._choice(ALIASES.get(text, text) if ALIASES.get(text) in self.choices else text)
        if self.kind is str and not _is_utf8(text):
            raise UsageError(f"{self.flag} must be UTF-8 text, and {text!r} holds bytes that are not (check the "
                             "terminal's or the file's encoding)")
        try:
            value = BOOLS[text.lower()] if self.kind is bool else self.kind(text)
        except (KeyError, ValueError):
            raise UsageError(f"{self.flag} must be {self.describe()}, not {text!r}") from None
        if self.kind in (int, float) and not _within(value, self.bound):
            raise UsageError(f"{self.flag} must be {self.describe()}, not {text!r}")
        return str(value.expanduser()) if self.kind is Path else value

    def _choice(self, text: str):
        for choice in self.choices:
            if str(choice) == text:
                return choice
        aliases = [alias for alias, name in ALIASES.items() if name in self.choices]
        also = f" (or {', '.join(aliases)})" if aliases else ""
        raise UsageError(f"{self.flag} must be one of {', '.join(map(str, self.choices))}{also}, not {text!r}")

    def describe(self) -> str:
        whole = self.kind is int
        if self.bound == POSITIVE:
            return "a positive whole number" if whole else "a positive number"
        if self.bound == NOT_NEGATIVE:
            return "a whole number ≥ 0" if whole else "a number ≥ 0"
        return {int: "a whole number", float: "a number", bool: "a switch", Path: "a path"}.get(self.kind, "text")

    def metavar(self) -> str:
        if self.choices:
            return "|".join(map(str, self.choices))
        return {int: "N", float: "X", bool: "", Path: "PATH"}.get(self.kind, self.name.upper())


def _is_utf8(text: str) -> bool:
    """Whether a command-line word was valid UTF-8 (Python keeps invalid bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _within(value: float, bound: str | None) -> bool:
    return bound is None or (value > 0 if bound == POSITIVE else value >= 0)


def flags_of(fn) -> dict[str, Flag]:
    """{parameter name: Flag} of a command function, read from its signature and type hints."""
    hints = get_type_hints(fn, include_extras=True)
    return {name: _flag(name, hints.get(name, str), param.default)
            for name, param in inspect.signature(fn).parameters.items()}


def _flag(name: str, hint, default) -> Flag:
    extras: list = []
    while get_origin(hint) in (Annotated, Union, types.UnionType):
        if get_origin(hint) is Annotated:
            hint, *rest = get_args(hint)
            extras += rest
        else:  # X | None
            hint = next(arg for arg in get_args(hint) if arg is not type(None))
    choices = get_args(hint) if get_origin(hint) is Literal else ()
    kind = type(choices[0]) if choices else list if get_origin(hint) is list else hint
    env = next((extra.name for extra in extras if isinstance(extra, Env)), None)
    bound = next((extra for extra in extras if extra in (POSITIVE, NOT_NEGATIVE)), None)
    return Flag(name, kind, default, choices, bound, env, PASSTHROUGH in extras)


def check_argv(command: str, fn, argv: list[str]) -> list[str]:
    """`argv` (after the command's name) as `--name=value` words, one per flag given; every value checked."""
    flags = flags_of(fn)
    words, extra = _split_passthrough(argv)
    values = _named_values(command, flags, words)
    passthrough = next((f for f in flags.values() if f.passthrough), None)
    if extra is not None:
        if passthrough is None:
            raise UsageError(f"{command} takes no arguments after --")
        values[passthrough.name] = json.dumps(extra)
    for flag in flags.values():
        if flag.name not in values and flag.env and os.environ.get(flag.env):
            values[flag.name] = _from_env(flag)
    missing = [f.flag for f in flags.values() if f.required and f.name not in values]
    if missing:
        raise UsageError(f"{command} needs {' and '.join(missing)} (see `trtglm {command} --help`)")
    for name, text in values.items():
        flags[name].convert(text)  # the one-line error now, before fire starts
    return [f"--{name}={text}" for name, text in values.items()]


def _from_env(flag: Flag) -> str:
    try:
        flag.convert(os.environ[flag.env])
    except UsageError as e:
        raise UsageError(f"${flag.env} (for {flag.flag}): {e}") from None
    return os.environ[flag.env]


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def _named_values(command: str, flags: dict[str, Flag], words: list[str]) -> dict[str, str]:
    """{parameter: text}: `--flag value`, `--flag=value`, `--flag` / `--no-flag` (booleans), repeats of a
    list flag, and bare words filling the parameters not named, in order."""
    values: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    positional: list[str] = []
    i = 0
    while i < len(words):
        word, i = words[i], i + 1
        if not word.startswith("--"):
            positional.append(word)
            continue
        flag, text, i = _read_flag(command, flags, word, words, i)
        if flag.kind is list:
            repeated.setdefault(flag.name, []).append(text)
        else:
            values[flag.name] = text
    values.update({name: json.dumps(texts) for name, texts in repeated.items()})
    free = [f for f in flags.values() if f.name not in values and not f.passthrough]
    if len(positional) > len(free):
        raise UsageError(f"{command}: unexpected argument {positional[len(free)]!r}")
    values.update({flag.name: text for flag, text in zip(free, positional)})
    return values


def _read_flag(command: str, flags: dict[str, Flag], word: str, words: list[str], i: int) -> tuple[Flag, str, int]:
    """The flag `word` names, its text, and the index of the next word."""
    key, has_value, text = word[2:].partition("=")
    name = key.replace("-", "_")
    if HIDDEN_FLAGS.get(name) in flags:
        name = HIDDEN_FLAGS[name]
    if name not in flags and name.startswith("no_") and flags.get(name[3:], Flag("", str, None)).kind is bool:
        return flags[name[3:]], "false", i  # --no-check
    if name not in flags or flags[name].passthrough:
        known = ", ".join(f.flag for f in flags.values() if not f.passthrough)
        raise UsageError(f"{command}: unknown flag --{key} (known: {known})")
    flag = flags[name]
    if has_value:
        return flag, text, i
    if flag.kind is bool:
        return flag, "true", i
    if i >= len(words) or words[i].startswith("--"):  # a value that starts so is given as --flag=--value
        raise UsageError(f"{command}: {flag.flag} needs a value ({flag.describe()})")
    return flag, words[i], i + 1


def fire_parse_fns(fn) -> dict:
    """fire's per-parameter parse functions (fire.decorators.SetParseFns) for `fn`'s flags."""
    return {name: flag.convert for name, flag in flags_of(fn).items()}


def usage(command: str, fn) -> str:
    """`usage: trtglm COMMAND FLAGS`, the docstring, and one line per flag (type, choices, default, env)."""
    flags = flags_of(fn).values()
    shown = [_usage_word(flag) for flag in flags if not flag.passthrough]
    tail = " [-- TRITONSERVER FLAGS]" if any(f.passthrough for f in flags) else ""
    lines = [f"usage: trtglm {command} {' '.join(shown)}{tail} [--verbose]", "", inspect.cleandoc(fn.__doc__ or ""),
             "", "flags:"]
    width = max((len(flag.flag) for flag in flags), default=0)
    lines += [f"  {flag.flag:<{width}}  {_flag_line(flag)}" for flag in flags if not flag.passthrough]
    return "\n".join(lines)


def _usage_word(flag: Flag) -> str:
    word = f"--no-{flag.flag[2:]}" if flag.default is True else f"{flag.flag} {flag.metavar()}".rstrip()
    return word if flag.required else f"[{word}]" + (" …" if flag.kind is list else "")


def _flag_line(flag: Flag) -> str:
    parts = [flag.describe() if not flag.choices else "one of " + ", ".join(map(str, flag.choices))]
    aliases = [f"{alias}={name}" for alias, name in ALIASES.items() if name in flag.choices]
    if aliases:
        parts.append("also " + ", ".join(aliases))
    if flag.kind is list:
        parts.append("may repeat")
    if flag.kind is bool:
        parts.append(f"{flag.flag} or --no-{flag.flag[2:]}; default {'on' if flag.default else 'off'}")
    else:
        parts.append("required" if flag.required else "optional" if flag.default is None else f"default {flag.default}")
    if flag.env:
        parts.append(f"or ${flag.env}")
    return "; ".join(parts)
