"""The command line itself: subcommand table, flag checking, exit codes, logging."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from trtglm.cli import COMMANDS


def test_every_subcommand_has_help():
    for name in COMMANDS:
        proc = run_cli(name, "--help")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: trtglm {name} ")


@pytest.mark.parametrize("args, message", [
    (("convert", "--model-dir", "m", "--output-dir", "o", "--tp", "2"), "unknown flag --tp"),
    (("verify", "--checkpoint", "c", "--hf-modle", "h"), "unknown flag --hf-modle"),
])
def test_unknown_flag_is_one_line_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_unknown_subcommand_is_one_line_exit_2():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "unknown command 'frobnicate'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_overview_lists_every_command():
    proc = run_cli()
    assert proc.returncode == 0
    assert all(f"  {name} " in proc.stdout for name in COMMANDS)


def test_string_flags_are_kept_verbatim(tmp_path):
    """fire would turn '[1, 2]' or '007' into a list or a number; string flags must stay text."""
    proc = run_cli("convert", "--model-dir", "007", "--output-dir", tmp_path / "o")
    assert proc.returncode == 3 and "007: model folder not found" in proc.stderr


def test_user_error_is_one_line_with_its_exit_code(tmp_path):
    proc = run_cli("convert", "--model-dir", tmp_path / "missing", "--output-dir", tmp_path / "out")
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("trtglm: error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_verbose_enables_debug_logging(tmp_path):
    quiet = run_cli("synth-model", "--preset", "tiny", "--out", tmp_path / "a")
    loud = run_cli("synth-model", "--preset", "tiny", "--out", tmp_path / "b", "--verbose")
    assert quiet.returncode == loud.returncode == 0, quiet.stderr + loud.stderr
    assert "DEBUG" not in quiet.stderr and "DEBUG trtglm: trtglm 0." in loud.stderr


@pytest.mark.parametrize("value", ["big", 0, -64, 3.5, True, None])
def test_a_config_with_a_bad_number_is_one_line(tmp_path, fixture_dir, value):
    model = tmp_path / "model"
    shutil.copytree(fixture_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": value}))
    done = run_cli("convert", "--model-dir", model, "--output-dir", tmp_path / "out")
    assert done.returncode == 3
    assert done.stderr.strip() == f"trtglm: error: config.json: hidden_size must be a whole number above 0, not {value!r}"
    assert not (tmp_path / "out").exists()


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, fixture_dir):
    done = run_cli("convert", "--model-dir", fixture_dir, "--output-dir", "/proc/trtglm-out")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("trtglm: error: No such file or directory: /proc/trtglm-out")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (("convert", "--model-dir", "m"), "convert needs --output-dir"),
    (("bench", "serving", "--requests"), "bench serving: --requests needs a value"),
    (("convert", "--model-dir", "m", "--output-dir", "o", "--pp-size", "two"),
     "--pp-size must be a positive whole number, not 'two'"),
    (("convert", "--model-dir", "m", "--output-dir", "o", "--tp-size", "3"), "--tp-size must be one of 1, 2, 4, 8, not '3'"),
    (("generate", "--prompt", "hi", "--timeout", "-1"), "--timeout must be a positive number, not '-1'"),
    (("convert", "--model-dir", "m", "--output-dir", "o", "--dtype", "fp8"),
     "--dtype must be one of auto, float16, bfloat16, float32 (or fp16, bf16, fp32), not 'fp8'"),
    (("models", "reload", "x"), "--action must be one of load, unload, list, not 'reload'"),
    (("stop", "--repo", "r", "extra"), "stop: unexpected argument 'extra'"),
    (("convert", "--model-dir", "m", "--output-dir", "o", "--", "--x"), "convert takes no arguments after --"),
    (("generate", "--url", "http://[::1", "--prompt", "hi"), "--url http://[::1: expected http://HOST:PORT"),
    (("chat", "--openai", "http://[::1", "--prompt", "hi"), "--openai http://[::1: expected http://HOST:PORT/v1"),
    (("generate", "--prompt", "\udcff\udcfe hi"), "--prompt must be UTF-8 text"),  # bytes ff fe in argv
    (("generate", "--prompt", "hi", "--max-tokens", str(2**40)),
     "--max-tokens must be a whole number from 1 to 2147483647 (Triton's INT32), not 1099511627776"),
])
def test_a_missing_or_malformed_flag_is_one_line_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"trtglm: error: {message}")
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr


def test_a_malformed_environment_fallback_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trtglm", "launch", "--repo", str(tmp_path)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "HTTP_PORT": "eighty"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == ("trtglm: error: $HTTP_PORT (for --http-port): --http-port must be a positive whole "
                           "number, not 'eighty'\n")


def test_version_and_help_list_choices():
    from trtglm import __version__

    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout == f"trtglm {__version__}\n"
    usage = run_cli("convert", "--help").stdout
    assert "[--dtype auto|float16|bfloat16|float32]" in usage and "also fp16=float16" in usage
    assert "--http-port" in run_cli("launch", "--help").stdout and "$HTTP_PORT" in run_cli("launch", "--help").stdout


@pytest.mark.parametrize("alias, dtype", [("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")])
def test_dtype_aliases(tmp_path, fixture_dir, alias, dtype):
    done = run_cli("convert", "--model-dir", fixture_dir, "--output-dir", tmp_path / "out", "--dtype", alias)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == dtype


def test_every_bench_kind_has_help():
    from trtglm.cli.bench import KINDS

    for kind in KINDS:
        proc = run_cli("bench", kind, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: trtglm bench {kind} "), proc.stderr


def test_the_output_budget_is_max_tokens_everywhere_and_max_new_tokens_a_hidden_alias():
    from trtglm.cli.flags import check_argv

    for command in ("chat", "verify", "generate"):
        usage = run_cli(command, "--help").stdout
        assert "--max-tokens" in usage and "--max-new-tokens" not in usage, command
    assert check_argv("chat", COMMANDS["chat"], ["--max-new-tokens", "5"]) == ["--max_tokens=5"]
    refused = run_cli("chat", "--max-new-tokens", "0", "--prompt", "hi")
    assert refused.returncode == 2 and "--max-tokens must be a positive whole number" in refused.stderr
