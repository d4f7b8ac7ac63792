"""The `trtglm` command: one subcommand per pipeline stage, each a function in this package's
module for its stage (convert, engine, repo, serve, client, bench), called by fire.

A function's signature is its flags (flags.py); its docstring is its help. Every subcommand
takes `--verbose` (debug logging). Errors a user can cause are `TrtglmError`s: one line on
stderr and the exit code of their type; a missing, unknown or malformed flag exits 2.
"""

from __future__ import annotations

import logging
import sys

from trtglm import __version__
from trtglm.cli import bench, client, convert, engine, repo, serve
from trtglm.cli.flags import check_argv, fire_parse_fns, usage
from trtglm.errors import TrtglmError, UsageError

log = logging.getLogger("trtglm")

COMMANDS = {
    "convert": convert.convert,
    "verify": convert.verify,
    "chat": client.chat,
    "synth-model": convert.synth_model,
    "build-engine": engine.build_engine,
    "warmup": engine.warmup,
    "plan": engine.plan,
    "patch-repo": repo.patch_repo,
    "launch": serve.launch,
    "stop": serve.stop,
    "status": serve.status,
    "logs": serve.logs,
    "models": serve.models,
    "generate": client.generate,
    "bench": bench.KINDS,
}


def main(argv: list[str] | None = None) -> None:
    argv, verbose = _pop_verbose(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s")
    log.debug("trtglm %s: %s", __version__, " ".join(argv))
    try:
        _run(argv)
    except TrtglmError as e:
        print(f"trtglm: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("trtglm: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
    except OSError as e:  # a folder that cannot be written, a disk full, ...: the system's words, one line
        where = f": {e.filename}" if e.filename else ""
        print(f"trtglm: error: {e.strerror or e}{where}", file=sys.stderr)
        sys.exit(1)


def _pop_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """`--verbose`/`-v` anywhere before `--` (words after it belong to another program)."""
    end = argv.index("--") if "--" in argv else len(argv)
    own = [a for a in argv[:end] if a not in ("--verbose", "-v")]
    return own + argv[end:], len(own) < end


def _run(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_overview())
        return
    if argv[0] == "--version":
        print(f"trtglm {__version__}")
        return
    name, fn, rest = _resolve(argv)
    if fn is None:
        print("\n\n".join(usage(f"{name} {kind}", kind_fn) for kind, kind_fn in COMMANDS[name].items()))
    elif any(word in ("-h", "--help") for word in rest[:rest.index("--") if "--" in rest else len(rest)]):
        print(usage(name, fn))
    else:
        _call(name, fn, check_argv(name, fn, rest))


def _resolve(argv: list[str]) -> tuple[str, object, list[str]]:
    """(command name, its function or None for a group's overview, the words after the name)."""
    entry = COMMANDS.get(argv[0])
    if entry is None:
        raise UsageError(f"unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})")
    if not isinstance(entry, dict):
        return argv[0], entry, argv[1:]
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        return argv[0], None, []
    if argv[1] not in entry:
        raise UsageError(f"{argv[0]}: unknown kind {argv[1]!r} (choose from {', '.join(entry)})")
    return f"{argv[0]} {argv[1]}", entry[argv[1]], argv[2:]


def _call(name: str, fn, words: list[str]) -> None:
    import fire

    fire.decorators.SetParseFns(**fire_parse_fns(fn))(fn)
    fire.Fire(fn, command=words, name=f"trtglm {name}")


def _overview() -> str:
    lines = ["usage: trtglm COMMAND [FLAGS] [--verbose]", "       trtglm --version", "", "commands:"]
    width = max(map(len, COMMANDS))
    for name, entry in COMMANDS.items():
        if isinstance(entry, dict):
            summary = f"benchmarks: {' | '.join(entry)} (`trtglm {name} KIND --help`)"
        else:
            summary = (entry.__doc__ or "").strip().splitlines()[0]
        lines.append(f"  {name:<{width}}  {summary}")
    lines.append("\n`trtglm COMMAND --help` describes a command's flags.")
    return "\n".join(lines)
