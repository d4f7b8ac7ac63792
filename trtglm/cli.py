"""The `trtglm` command: one subcommand per pipeline stage, each delegating to one module.

Every subcommand takes `--verbose` (debug logging). Errors a user can cause are
`TrtglmError`s: one line on stderr and the exit code of their type.
"""

from __future__ import annotations

import logging
import sys

from trtglm import __version__
from trtglm.errors import TrtglmError

log = logging.getLogger("trtglm")


def convert(model_dir: str, output_dir: str, dtype: str = "auto", tp_size: int = 1, pp_size: int = 1,
            weight_only: str | None = None, chatglm_version: str = "auto", force: bool = False):
    """ChatGLM HF weights -> TensorRT-LLM checkpoint (config.json + rank{r}.safetensors)."""
    from trtglm.convert.writer import convert_checkpoint

    convert_checkpoint(model_dir, output_dir, dtype=dtype, tp_size=tp_size, pp_size=pp_size,
                       weight_only=weight_only, chatglm_version=chatglm_version, force=force)


def verify(checkpoint: str, hf_model: str, prompts: str | None = None, max_new_tokens: int = 16,
           device: str = "cpu"):
    """Compare a TensorRT-LLM checkpoint, run by trtglm's runtime, with transformers' GlmForCausalLM."""
    from trtglm.runtime.verify import verify_checkpoint

    verify_checkpoint(checkpoint, hf_model, prompts=prompts, max_new_tokens=max_new_tokens, device=device)


def chat(checkpoint: str, tokenizer_dir: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
         top_k: int = 0, top_p: float = 1.0, seed: int | None = None, device: str = "cpu"):
    """Answer PROMPT (text, or a JSON list of chat messages) from a checkpoint with trtglm's runtime."""
    from trtglm.runtime.answer import answer

    print(answer(checkpoint, tokenizer_dir, str(prompt), max_new_tokens=max_new_tokens, temperature=temperature,
                 top_k=top_k, top_p=top_p, seed=seed, device=device))


def synth_model(preset: str, out: str, layers: int | None = None, format: str = "safetensors",
                dtype: str = "float16", seed: int = 0, force: bool = False):
    """Random-weight ChatGLM3 checkpoint with the real HF layout and shapes (tiny, 6b, 6b-32k)."""
    from trtglm.convert.synth import synth_model as run

    run(preset, out, layers=layers, fmt=format, dtype=dtype, seed=seed, force=force)


def _commands() -> dict:
    from trtglm.bench import served_command, serving
    from trtglm.bench.cli_commands import runtime
    from trtglm.client.cli_commands import generate
    from trtglm.engine.cli_commands import build_engine, plan
    from trtglm.repo.cli_commands import patch_repo
    from trtglm.serve.cli_commands import launch, models, stop

    return {
        "convert": convert,
        "verify": verify,
        "chat": chat,
        "synth-model": synth_model,
        "build-engine": build_engine,
        "plan": plan,
        "patch-repo": patch_repo,
        "launch": launch,
        "stop": stop,
        "models": models,
        "generate": generate,
        "bench": {"runtime": runtime, "serving": serving, "served": served_command},
    }


COMMANDS = _commands()


def _pop_verbose(argv: list[str]) -> tuple[list[str], bool]:
    flags = {"--verbose", "-v"}
    return [a for a in argv if a not in flags], any(a in flags for a in argv)


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
    except OSError as e:  # a folder that cannot be written, a disk full, ...: the system's words, one line
        where = f": {e.filename}" if e.filename else ""
        print(f"trtglm: error: {e.strerror or e}{where}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()


def _run(argv: list[str]) -> None:
    import fire

    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_overview())
    elif argv[0] not in COMMANDS:
        print(f"trtglm: error: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    elif isinstance(COMMANDS[argv[0]], dict) and (len(argv) < 2 or argv[1] not in COMMANDS[argv[0]]):
        group = COMMANDS[argv[0]]
        if len(argv) > 1 and argv[1] not in ("-h", "--help"):
            print(f"trtglm {argv[0]}: error: unknown kind {argv[1]!r} (choose from {', '.join(group)})",
                  file=sys.stderr)
            sys.exit(2)
        print("\n\n".join(_usage(f"{argv[0]} {kind}", fn) for kind, fn in group.items()))
    elif "-h" in argv or "--help" in argv:
        print(_usage(*_command(argv)[:2]))
    else:
        fire.Fire(COMMANDS, command=_prepare_argv(argv), name="trtglm")


def _command(argv: list[str]) -> tuple[str, object, int]:
    """(name, function, number of argv words naming it) for `argv`; groups take two words."""
    entry = COMMANDS[argv[0]]
    if isinstance(entry, dict):
        return f"{argv[0]} {argv[1]}", entry[argv[1]], 2
    return argv[0], entry, 1


def _overview() -> str:
    lines = ["usage: trtglm COMMAND [FLAGS] [--verbose]", "", "commands:"]
    width = max(map(len, COMMANDS))
    for name, entry in COMMANDS.items():
        if isinstance(entry, dict):
            entry = next(iter(entry.values()))
            summary = f"benchmarks: {' | '.join(COMMANDS[name])} (`trtglm {name} KIND --help`)"
        else:
            summary = (entry.__doc__ or "").strip().splitlines()[0]
        lines.append(f"  {name:<{width}}  {summary}")
    lines.append("\n`trtglm COMMAND --help` describes a command's flags.")
    return "\n".join(lines)


def _usage(name: str, fn) -> str:
    import inspect

    flags = []
    for param in inspect.signature(fn).parameters.values():
        flag = "--" + param.name.replace("_", "-")
        if param.default is inspect.Parameter.empty:
            flags.append(f"{flag} {param.name.upper()}")
        elif param.default is False:
            flags.append(f"[{flag}]")
        elif param.default is True:
            flags.append(f"[--no-{param.name.replace('_', '-')}]")
        else:
            flags.append(f"[{flag} {param.default if param.default is not None else param.name.upper()}]")
    return f"usage: trtglm {name} {' '.join(flags)} [--verbose]\n\n{inspect.cleandoc(fn.__doc__ or '')}"


def _prepare_argv(argv: list[str]) -> list[str]:
    """Refuse unknown flags with one line, and keep string flags as typed.

    fire reads every value as a Python literal ("[1, 2]" becomes a list, "007" a number); a
    flag declared `str` is passed on as the repr of its text, which fire reads back verbatim.
    `--set` may repeat: its values reach the command as one list of KEY=VALUE strings.
    """
    import inspect

    command, fn, words = _command(argv)
    params = inspect.signature(fn).parameters
    argv, sets = _collect_sets(argv)
    out, i = argv[:words] + ([f"--set={sets!r}"] if sets else []), words
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            out.append(arg)
            continue
        flag, has_value, value = arg[2:].partition("=")
        key = flag.replace("-", "_")
        if key not in params and not (key.startswith("no") and key[2:] in params):
            known = ", ".join("--" + p.replace("_", "-") for p in params)
            print(f"trtglm {command}: error: unknown flag --{flag} (known: {known})", file=sys.stderr)
            sys.exit(2)
        if not _is_str_flag(params.get(key)):
            out.append(arg)
            continue
        if not has_value and i < len(argv):
            value, has_value, i = argv[i], True, i + 1
        out.append(f"--{flag}={value!r}" if has_value else arg)
    return out


def _collect_sets(argv: list[str]) -> tuple[list[str], list[str]]:
    rest, sets, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--set" and i + 1 < len(argv):
            sets.append(argv[i + 1])
            i += 2
        elif argv[i].startswith("--set="):
            sets.append(argv[i][len("--set="):])
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return rest, sets


def _is_str_flag(param) -> bool:
    annotation = getattr(param, "annotation", None)
    return isinstance(annotation, str) and annotation.split("|")[0].strip() == "str"


if __name__ == "__main__":
    main()
