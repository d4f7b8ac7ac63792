"""The README's GPU quick start, run as written on this machine: the commands of its two blocks ("On a
GPU machine": trtglm's runtime, then NVIDIA's container) in order, with only the model's place, the
profile's size limits and the ports changed to fit the tiny fixture on a CPU.

The torch block runs whole: `build-engine` picks trtglm's runtime (no `trtllm-build` on PATH) and says
so as the README shows, then patch-repo, launch, the curl and stop. The container block builds with the
`trtllm-build` stand-in on PATH (tests/stand_ins: it records its argv and writes an engine folder), so
`build.engine auto` picks TensorRT and says so; patch-repo renders that engine, and its generate line
asks the torch block's server (a TensorRT engine cannot be launched here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FIXTURE, REPO
from support.servers import free_port

pytestmark = pytest.mark.slow

MODEL_DIR = "/models/chatglm3-6b"  # where the README's commands read the model
FITTED_LIMITS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")  # the 6B profiles' exceed the
# fixture's; the batch also sets how many BLS and history-model stubs start (serve.bls_instances 0)
STAND_INS = REPO / "tests" / "stand_ins"


def gpu_blocks() -> list[list[tuple[str, str]]]:
    """The README's GPU section's bash blocks, each a list of (command, the output the README shows after it
    in a `#   …` comment, or "")."""
    section = README_TEXT.split("### On a GPU machine", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        steps: list[tuple[str, str]] = []
        for line in body.splitlines():
            shown = re.match(r"#\s+…\s*(.*)", line.strip())
            if shown:
                steps[-1] = (steps[-1][0], shown.group(1))
            elif line.strip():
                steps.append((line.split("  #", 1)[0].strip(), ""))
        blocks.append(steps)
    return blocks


README_TEXT = (REPO / "README.md").read_text(encoding="utf-8")


def fitted_profile(name: str, into: Path) -> None:
    """configs/NAME as the repository has it, for the fixture: its model, and limits no longer than its own."""
    profile = yaml.safe_load((REPO / "configs" / name).read_text())
    tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    profile["model"] = {**tiny["model"], "dir": str(FIXTURE)}
    profile["build"].update({key: tiny["build"][key] for key in FITTED_LIMITS})
    (into / "configs").mkdir(exist_ok=True)
    (into / "configs" / name).write_text(yaml.safe_dump(profile))


class Shell:
    """Runs README lines in a folder of its own, as a user would, with the fixture for the model."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env = cwd, env
        cwd.mkdir()

    def run(self, command: str) -> str:
        """The command's output (stdout and stderr); it must succeed."""
        for name in re.findall(r"--config (\S+)", command):
            fitted_profile(Path(name).name, self.cwd)
        command = command.replace(MODEL_DIR, str(FIXTURE)).replace("127.0.0.1:8000",
                                                                   f"127.0.0.1:{self.env['HTTP_PORT']}")
        done = subprocess.run(command, shell=True, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr


def pairwise_flags(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv[0::2], argv[1::2]))


def install_line(command: str) -> None:
    """The install line asks for extras the project declares (the venv already has them)."""
    extras = re.search(r"\.\[([a-z,]+)\]", command).group(1).split(",")
    declared = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", (REPO / "pyproject.toml").read_text(),
                         flags=re.S).group(1)
    assert command.startswith("python3 -m pip install -e ") and extras, command
    assert all(re.search(rf"^{extra}\s*=", declared, flags=re.M) for extra in extras), (extras, declared)


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HTTP_PORT": str(free_port()), "GRPC_PORT": str(free_port()), "METRICS_PORT": str(free_port()),
           "OPENAI_PORT": str(free_port())}
    env.pop("TRTLLM_STANDIN_EXPECT", None)
    return env


def test_the_readmes_gpu_commands_run_as_written(tmp_path, env):
    torch_block, container_block = gpu_blocks()
    install_line(torch_block[0][0])
    *serve, (stop, _) = torch_block[1:]
    assert stop.startswith("trtglm stop"), torch_block
    here = Shell(tmp_path / "torch", env)
    try:
        for command, shown in serve:
            out = here.run(command)
            assert shown in out, (command, shown, out)
            if command.startswith("curl"):
                assert json.loads(out)["text_output"], out
        run_container_block(Shell(tmp_path / "container", dict(env)), container_block)
    finally:
        stopped = subprocess.run(stop, shell=True, cwd=here.cwd, env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, (stopped.stdout, stopped.stderr)


def run_container_block(there: Shell, block: list[tuple[str, str]]) -> None:
    """NVIDIA's container's block with the trtllm-build stand-in on PATH: build and patch-repo run; its
    generate line asks the server the torch block launched (its launch and stop need NVIDIA's backend)."""
    log = there.cwd / "trtllm-build.jsonl"
    there.env.update(PATH=f"{STAND_INS}{os.pathsep}{there.env['PATH']}", TRTLLM_STANDIN_LOG=str(log))
    verbs = [shlex.split(command)[:2] for command, _ in block]
    assert verbs == [["trtglm", "build-engine"], ["trtglm", "patch-repo"], ["trtglm", "launch"],
                     ["trtglm", "generate"], ["trtglm", "stop"]], verbs
    (build, shown), (patch, _), _, (generate, _), _ = block
    out = there.run(build)
    assert f"{shown.split(' (')[0]} (trtllm-build at {STAND_INS / 'trtllm-build'})" in out, (shown, out)
    engine = re.search(r"--engine-dir (\S+)", patch).group(1)
    options = dict(pairwise_flags(json.loads(log.read_text().splitlines()[0])))
    profile = yaml.safe_load((there.cwd / re.search(r"--config (\S+)", build).group(1)).read_text())
    assert options["--checkpoint_dir"] == f"{engine}/checkpoint" and options["--output_dir"].startswith(f"{engine}/")
    assert int(options["--max_batch_size"]) == profile["build"]["max_batch_size"], options
    assert "tensorrt engine" in there.run(patch)
    assert there.run(generate).strip()
