"""`trtglm verify` on converted fixture checkpoints, and the runtime's answers to the fixture's chats
(`generate` and `trtglm chat`).

The precision × tensor-parallel matrix goes through `trtglm.cli.main` in this process (the
same code path as the command, without paying for a fresh interpreter 28 times); the
cases that check exit codes and messages run the real command in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from support.cli_calls import convert_checkpoint

from trtglm import cli
from trtglm.chatglm import chat
from trtglm.chatglm.tokenizer import ChatGLMTokenizer
from trtglm.errors import VerificationError
from trtglm.runtime.generate import generate
from trtglm.runtime.model import load_model

PRECISIONS = [("float32", None), ("float16", None), ("bfloat16", None),
              ("float16", "int8"), ("float16", "int4"), ("bfloat16", "int8"), ("bfloat16", "int4")]
TP_SIZES = (1, 2, 4, 8)
VERIFY_EXIT = VerificationError.exit_code


@pytest.fixture(scope="module")
def conversations(fixture_dir) -> list[dict]:
    lines = (fixture_dir / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, fixture_dir):
    made: dict[tuple, Path] = {}

    def convert(tp: int, dtype: str = "float32", weight_only: str | None = None, source: Path | None = None) -> Path:
        key = (tp, dtype, weight_only, source)
        if key not in made:
            out = tmp_path_factory.mktemp("ckpt") / f"tp{tp}-{dtype}-{weight_only}"
            made[key] = convert_checkpoint(source or fixture_dir, out, dtype=dtype, tp_size=tp, weight_only=weight_only)
        return made[key]

    return convert


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, conversations) -> Path:
    """Two of the fixture's conversations (one with history) as a --prompts JSONL file."""
    chosen = [conversations[0], max(conversations, key=lambda c: len(c["messages"]))]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in chosen), encoding="utf-8")
    return path


def verify_in_process(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stdout) of `trtglm verify ARGS` run through the CLI entry point in this process."""
    try:
        cli.main(["verify", *map(str, args)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("dtype, weight_only", PRECISIONS, ids=[f"{d}-{w or 'float'}" for d, w in PRECISIONS])
def test_verify_passes(converted, fixture_dir, prompts_file, capsys, tp, dtype, weight_only):
    ckpt = converted(tp, dtype, weight_only)
    code, out = verify_in_process(capsys, "--checkpoint", ckpt, "--hf-model", fixture_dir,
                                  "--prompts", prompts_file, "--max-new-tokens", 6)
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith("prompt ")]
    assert len(rows) == 2
    assert out.rstrip().endswith("PASS")
    assert f"tp {tp}" in out and dtype in out


def test_verify_command_with_default_inputs(converted, fixture_dir):
    proc = run_cli("verify", "--checkpoint", converted(2, "bfloat16", "int8"), "--hf-model", fixture_dir,
                   "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    assert "chat 'hi'" in proc.stdout and "random 16 ids" in proc.stdout
    assert "Δ unquant" in proc.stdout and proc.stdout.rstrip().endswith("PASS")


def test_verify_reads_a_text_prompt_file(converted, fixture_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What color is the sky?\n\nWhat is two plus three?\n", encoding="utf-8")
    code, out = verify_in_process(capsys, "--checkpoint", converted(1), "--hf-model", fixture_dir, "--prompts", prompts,
                                  "--max-new-tokens", 2)
    assert code == 0 and "prompt 2" in out and "prompt 3" not in out


def _swap_rank_qkv(folder: Path) -> None:
    ranks = [load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1)]
    for kind in ("weight", "bias"):
        name = f"transformer.layers.1.attention.qkv.{kind}"
        ranks[0][name], ranks[1][name] = ranks[1][name], ranks[0][name]
    for r, tensors in enumerate(ranks):
        save_file(tensors, str(folder / f"rank{r}.safetensors"))


def _other_weights(fixture_dir: Path, out: Path) -> Path:
    """The fixture with one layer's MLP weights perturbed: same shapes, another model."""
    shutil.copytree(fixture_dir, out)
    name = "transformer.encoder.layers.2.mlp.dense_4h_to_h.weight"
    for shard in out.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if name in tensors:
            tensors[name] = tensors[name] + 0.05 * torch.randn(tensors[name].shape,
                                                               generator=torch.Generator().manual_seed(0))
            save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def assert_one_line_error(proc, code: int, *words: str) -> None:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trtglm: error:") and all(w in last for w in words), last


def test_verify_fails_on_swapped_rank_tensors(converted, fixture_dir, tmp_path, prompts_file):
    bad = tmp_path / "swapped"
    shutil.copytree(converted(2), bad)
    _swap_rank_qkv(bad)
    proc = run_cli("verify", "--checkpoint", bad, "--hf-model", fixture_dir, "--prompts", prompts_file,
                   "--max-new-tokens", 4)
    assert_one_line_error(proc, VERIFY_EXIT, "does not match", "max |Δlogit|")
    assert "FAIL" in proc.stdout


def test_verify_fails_for_a_checkpoint_of_another_model(converted, fixture_dir, tmp_path, prompts_file, capsys):
    other = converted(2, "bfloat16", source=_other_weights(fixture_dir, tmp_path / "other"))
    code, out = verify_in_process(capsys, "--checkpoint", other, "--hf-model", fixture_dir, "--prompts", prompts_file,
                                  "--max-new-tokens", 4)
    assert code == VERIFY_EXIT and out.rstrip().endswith("FAIL")


def test_verify_fails_for_a_checkpoint_of_another_shape(converted, fixture_dir, tmp_path):
    from support.cli_calls import synth_model

    synth = synth_model("tiny", tmp_path / "synth", dtype="float32")
    proc = run_cli("verify", "--checkpoint", converted(1, source=synth), "--hf-model", fixture_dir)
    assert_one_line_error(proc, VERIFY_EXIT, "does not match the HF model", "vocab_size")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_greedy_answers_are_exact(converted, fixture_dir, conversations, tp, dtype):
    tokenizer = ChatGLMTokenizer(fixture_dir)
    model = load_model(converted(tp, dtype))
    prompts = [chat.chat_ids(tokenizer, c["messages"]) for c in conversations]
    longest = max(len(tokenizer.encode(c["answer"], add_prefix=False)) for c in conversations)
    replies = generate(model, prompts, max_tokens=longest + 8, stop_ids=chat.stop_ids(tokenizer))
    wrong = [(c["answer"], tokenizer.decode(r)) for c, r in zip(conversations, replies)
             if chat.reply_text(tokenizer, r) != c["answer"]]
    assert not wrong, f"{len(wrong)}/{len(conversations)} wrong, e.g. {wrong[0]}"


def chat_in_process(capsys, checkpoint: Path, fixture_dir: Path, prompt: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `trtglm chat` run through the CLI entry point in this process."""
    try:
        cli.main(["chat", "--checkpoint", str(checkpoint), "--tokenizer-dir", str(fixture_dir), "--prompt", prompt])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_trtglm_chat_answers_the_fixtures_chats_exactly(capsys, converted, fixture_dir, conversations):
    with_history = max(conversations, key=lambda c: len(c["messages"]))
    for conversation, prompt in ((conversations[0], conversations[0]["messages"][0]["content"]),
                                 (with_history, json.dumps(with_history["messages"], ensure_ascii=False)),
                                 (with_history, json.dumps({"messages": with_history["messages"]}))):
        assert chat_in_process(capsys, converted(1), fixture_dir, prompt)[:2] == (0, conversation["answer"] + "\n")


@pytest.mark.parametrize("prompt, message", [
    ('{"messages": []}', '--prompt: "messages" must be a non-empty list'),
    ("[]", "--prompt is an empty chat"),
    ('[{"role": "robot", "content": "hi"}]', "message 0: role must be one of"),
    ("   ", "--prompt is empty"),
])
def test_trtglm_chat_refuses_bad_chats_in_one_line(capsys, converted, fixture_dir, prompt, message):
    code, out, err = chat_in_process(capsys, converted(1), fixture_dir, prompt)
    assert code != 0 and out == "" and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("trtglm: error:") and message in last, err
