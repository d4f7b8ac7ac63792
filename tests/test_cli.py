"""The command line itself: subcommand table, flag checking, exit codes, logging."""

import json
import shutil

import pytest

from conftest import run_cli
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
