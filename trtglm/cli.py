"""The `trtglm` command: one subcommand per pipeline stage, each delegating to one module.

Every subcommand takes `--verbose` (debug logging). Errors a user can cause are
`TrtglmError`s: one line on stderr and the exit code of their type.
"""

from __future__ import annotations

import logging
import sys

from trtglm.errors import TrtglmError

log = logging.getLogger("trtglm")


def convert(model_dir: str, output_dir: str, dtype: str = "auto", tp_size: int = 1, pp_size: int = 1,
            weight_only: str | None = None, chatglm_version: str = "auto", force: bool = False):
    """ChatGLM HF weights -> TensorRT-LLM checkpoint (config.json + rank{r}.safetensors)."""
    from trtglm.convert.writer import convert_checkpoint

    convert_checkpoint(model_dir, output_dir, dtype=dtype, tp_size=tp_size, pp_size=pp_size,
                       weight_only=weight_only, chatglm_version=chatglm_version, force=force)


def verify(checkpoint: str, hf_model: str, prompts: str | None = None, max_new_tokens: int = 16):
    """Compare a TensorRT-LLM checkpoint, run by trtglm's runtime, with transformers' GlmForCausalLM."""
    from trtglm.runtime.verify import verify_checkpoint

    verify_checkpoint(checkpoint, hf_model, prompts=prompts, max_new_tokens=max_new_tokens)


def synth_model(preset: str, out: str, layers: int | None = None, format: str = "safetensors",
                dtype: str = "float16", seed: int = 0, force: bool = False):
    """Random-weight ChatGLM3 checkpoint with the real HF layout and shapes (tiny, 6b, 6b-32k)."""
    from trtglm.convert.synth import synth_model as run

    run(preset, out, layers=layers, fmt=format, dtype=dtype, seed=seed, force=force)


COMMANDS = {
    "convert": convert,
    "verify": verify,
    "synth-model": synth_model,
}


def _pop_verbose(argv: list[str]) -> tuple[list[str], bool]:
    flags = {"--verbose", "-v"}
    return [a for a in argv if a not in flags], any(a in flags for a in argv)


def main(argv: list[str] | None = None) -> None:
    import fire

    argv, verbose = _pop_verbose(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s")
    if argv and argv[0] in COMMANDS and "-h" not in argv and "--help" not in argv:
        _check_flags(argv)
    try:
        fire.Fire(COMMANDS, command=argv, name="trtglm")
    except TrtglmError as e:
        print(f"trtglm: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("trtglm: interrupted", file=sys.stderr)
        sys.exit(130)


def _check_flags(argv: list[str]) -> None:
    """Refuse unknown flags with one line (fire would otherwise print a usage page)."""
    import inspect

    params = inspect.signature(COMMANDS[argv[0]]).parameters
    for arg in argv[1:]:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            if name.startswith("no") and name[2:] in params:
                continue
            if name not in params:
                known = ", ".join("--" + p.replace("_", "-") for p in params)
                print(f"trtglm {argv[0]}: error: unknown flag {arg.split('=', 1)[0]} (known: {known})",
                      file=sys.stderr)
                sys.exit(2)


if __name__ == "__main__":
    main()
