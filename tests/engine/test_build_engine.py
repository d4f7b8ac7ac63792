"""`build-engine` end to end on the fixture model: torch engines, and TensorRT builds through a
stand-in `trtllm-build` (tests/stand_ins) that checks its exact argv and writes an engine folder."""

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sentencepiece
import yaml

from conftest import REPO, run_cli
from support.cli_calls import build_engine
from trtglm.convert.staging import staged_output
from trtglm.engine.manifest import Limits, RankMapping, read_manifest
from trtglm.errors import DependencyError, ModelFileError, OutputExistsError, TrtglmError, UsageError
from trtglm.profile import load_profile
from trtglm.runtime.checkpoint import load_checkpoint

TINY = REPO / "configs" / "tiny.yaml"
STAND_INS = REPO / "tests" / "stand_ins"
TENSORRT = {"build.engine": "tensorrt", "convert.dtype": "float16"}
SPECIAL_TOKENS = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop",  # chatglm3.md, in this order after the pieces
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def expected_trtllm_argv(out: Path, staged: bool = True) -> list[str]:
    """trtllm-build's argv for tiny.yaml with engine tensorrt (limits as written in tiny.yaml); a build writes
    into its staging folder (this process's), a --dry-run shows OUT itself."""
    output_dir = out / f".trtllm-build.tmp-{os.getpid()}" if staged else out
    return ["--checkpoint_dir", str(out / "checkpoint"), "--output_dir", str(output_dir), "--max_batch_size", "8",
            "--max_input_len", "256", "--max_seq_len", "512", "--max_num_tokens", "2048", "--max_beam_width", "1",
            "--kv_cache_type", "paged", "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
            "--context_fmha", "enable", "--remove_input_padding", "enable", "--use_paged_context_fmha", "disable",
            "--tokens_per_block", "64"]


@pytest.fixture
def hf(tmp_path, fixture_dir) -> Path:
    """A private copy of the fixture model (tests touch its files)."""
    return Path(shutil.copytree(fixture_dir, tmp_path / "hf"))


class StandIn:
    def __init__(self, folder: Path, monkeypatch):
        self.log, self.expect_file, self.monkeypatch = folder / "calls.jsonl", folder / "expect.json", monkeypatch
        monkeypatch.setenv("PATH", f"{STAND_INS}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("TRTLLM_STANDIN_LOG", str(self.log))

    def expect(self, argv: list[str]) -> None:
        self.expect_file.write_text(json.dumps(argv), encoding="utf-8")
        self.monkeypatch.setenv("TRTLLM_STANDIN_EXPECT", str(self.expect_file))

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> StandIn:
    return StandIn(tmp_path, monkeypatch)


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def checkpoint_dtype(out: Path) -> str:
    return json.loads((out / "checkpoint" / "config.json").read_text())["dtype"]


# --- TensorRT through the stand-in ----------------------------------------------------------------


def test_dry_run_prints_the_exact_commands_and_needs_nothing(hf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no trtllm-build anywhere
    out = tmp_path / "engine"
    assert build_engine(TINY, model_dir=hf, output_dir=out, dry_run=True, overrides=TENSORRT) is None
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [shlex.split(c) for c in commands] == [
        ["trtglm", "convert", "--model-dir", str(hf), "--output-dir", str(out / "checkpoint"), "--dtype", "float16",
         "--tp-size", "1", "--pp-size", "1", "--chatglm-version", "chatglm3", "--force"],
        ["trtllm-build", *expected_trtllm_argv(out, staged=False)],
    ]
    assert not out.exists()


def test_build_runs_trtllm_build_with_the_exact_argv(hf, tmp_path, stand_in):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    assert build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT) == out
    assert stand_in.calls() == [expected_trtllm_argv(out)]
    manifest = read_manifest(out)
    assert manifest.engine == "tensorrt" and manifest.tensorrt_llm_version == "stand-in"
    assert manifest.engine_files == ["config.json", "rank0.engine"]
    assert manifest.limits == Limits(max_batch_size=8, max_input_len=256, max_seq_len=512, max_num_tokens=2048,
                                     max_beam_width=1)
    assert manifest.mapping == RankMapping(tp_size=1, pp_size=1) and manifest.mapping.world_size == 1
    assert json.loads((out / "trtglm.json").read_text())["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert (manifest.dtype, manifest.quantization) == ("float16", {"weight_only": None, "quant_algo": None,
                                                                   "kv_cache_quant_algo": None})
    assert checkpoint_dtype(out) == "float16"


def test_tensor_parallel_build_has_one_engine_per_rank(hf, tmp_path, stand_in):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "convert.tp_size": 2})
    manifest = read_manifest(out)
    assert manifest.engine_files == ["config.json", "rank0.engine", "rank1.engine"]
    assert manifest.mapping == RankMapping(tp_size=2, pp_size=1) and manifest.mapping.world_size == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["config.json", "rank0.safetensors",
                                                                      "rank1.safetensors"]


def test_weight_only_reaches_the_checkpoint_not_the_build_flags(hf, tmp_path, stand_in):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "convert.weight_only": "int8"})
    ckpt = json.loads((out / "checkpoint" / "config.json").read_text())
    assert ckpt["quantization"]["quant_algo"] == "W8A16"
    assert read_manifest(out).quantization == {"weight_only": "int8", "quant_algo": "W8A16",
                                               "kv_cache_quant_algo": None}


def test_fp8_reaches_the_checkpoint_not_the_build_flags(hf, tmp_path, stand_in):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "convert.fp8": True,
                                                                 "convert.fp8_kv_cache": True})
    ckpt = json.loads((out / "checkpoint" / "config.json").read_text())
    assert ckpt["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert read_manifest(out).quantization == {"weight_only": None, "quant_algo": "FP8",
                                               "kv_cache_quant_algo": "FP8"}


def test_fp8_for_a_variant_without_it_in_tensorrt_llm_is_one_line(hf, tmp_path, stand_in):
    with pytest.raises(UsageError, match="TensorRT-LLM's ChatGLM support matrix has no FP8 for chatglm3-6b-128k; "
                                         r"build it for trtglm's runtime \(build.engine: torch\)"):
        build_engine(TINY, model_dir=hf, output_dir=tmp_path / "e",
                     overrides={**TENSORRT, "model.variant": "chatglm3-6b-128k", "convert.fp8": True})
    assert stand_in.calls() == [] and not (tmp_path / "e").exists()


def test_a_failed_fp8_calibration_leaves_no_engine_and_keeps_the_old_one(hf, tmp_path):
    """An empty calibration set: one line, and the torch engine already built stays whole and in use."""
    out = build_engine(TINY, model_dir=hf, output_dir=tmp_path / "engine")
    before = read_manifest(out)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    fp8 = {"convert.fp8": True, "convert.dtype": "bfloat16", "convert.calibration_prompts": str(empty)}
    with pytest.raises(UsageError, match=f"--calibration-prompts {empty}: no prompts"):
        build_engine(TINY, model_dir=hf, output_dir=out, overrides=fp8, force=True)
    assert read_manifest(out) == before and load_checkpoint(out / "checkpoint").config.quant_algo is None
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    with pytest.raises(UsageError, match="no prompts"):
        build_engine(TINY, model_dir=hf, output_dir=tmp_path / "fresh", overrides=fp8)
    assert not (tmp_path / "fresh" / "trtglm.json").exists() and not (tmp_path / "fresh" / "checkpoint").exists()


def test_fresh_checkpoint_is_reused(hf, tmp_path, stand_in, caplog):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    before = mtimes(out / "checkpoint")
    caplog.set_level("INFO")
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT, force=True)
    assert "reusing checkpoint" in caplog.text and "converting" not in caplog.text
    assert mtimes(out / "checkpoint") == before
    assert len(stand_in.calls()) == 2


def test_stale_checkpoint_is_reconverted(hf, tmp_path, stand_in, caplog):
    out = tmp_path / "engine"
    stand_in.expect(expected_trtllm_argv(out))
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    caplog.set_level("INFO")
    build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "convert.dtype": "float32"}, force=True)
    assert "conversion settings changed (dtype float16 → float32)" in caplog.text
    assert checkpoint_dtype(out) == "float32" and read_manifest(out).dtype == "float32"
    caplog.clear()
    config = hf / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))  # the HF folder changed
    build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "convert.dtype": "float32"}, force=True)
    assert "HF model files changed" in caplog.text


def test_engine_limits_that_differ_from_the_profile_are_an_error(hf, tmp_path, stand_in, monkeypatch):
    out = tmp_path / "engine"
    monkeypatch.setenv("TRTLLM_STANDIN_BUILD_CONFIG", json.dumps({"max_seq_len": 1024}))
    with pytest.raises(ModelFileError, match=r"engine limits differ from the profile: max_seq_len 1024 \(profile: 512\)"):
        build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    assert not (out / "trtglm.json").exists()


def test_failed_trtllm_build_leaves_no_manifest_and_keeps_the_checkpoint(hf, tmp_path, stand_in, monkeypatch, caplog):
    out = tmp_path / "engine"
    monkeypatch.setenv("TRTLLM_STANDIN_EXIT", "3")
    with pytest.raises(TrtglmError, match="trtllm-build failed .exit status 3."):
        build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    assert not (out / "trtglm.json").exists() and (out / "checkpoint" / "config.json").exists()
    monkeypatch.delenv("TRTLLM_STANDIN_EXIT")
    caplog.set_level("INFO")
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)  # no engine there yet: no --force needed
    assert "reusing checkpoint" in caplog.text and read_manifest(out).engine == "tensorrt"


def engine_bytes(out: Path) -> dict[str, bytes]:
    """The engine's files (manifest, engine config, rank files) as they are on disk."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "checkpoint.source.json"}


def test_a_killed_tensorrt_rebuild_leaves_the_old_engine_working(hf, tmp_path, stand_in, monkeypatch):
    """`build-engine --force` killed (SIGKILL, trtllm-build with it) while trtllm-build writes: the engine
    already there is untouched, since trtllm-build writes into a staging folder; the next run removes that
    folder and replaces the engine."""
    out = tmp_path / "engine"
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    before = engine_bytes(out)
    monkeypatch.setenv("TRTLLM_STANDIN_PAUSE", "60")
    monkeypatch.setenv("TRTLLM_STANDIN_BUILD_CONFIG", json.dumps({"rebuilt": True}))
    monkeypatch.delenv("TRTLLM_STANDIN_EXPECT", raising=False)
    rebuild = subprocess.Popen(
        [sys.executable, "-m", "trtglm", "build-engine", "--config", str(TINY), "--model-dir", str(hf),
         "--output-dir", str(out), "--set", "build.engine=tensorrt", "--set", "convert.dtype=float16", "--force"],
        cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(".trtllm-build.tmp-*/config.json")) and time.monotonic() < deadline:
            assert rebuild.poll() is None, rebuild.stderr.read().decode()
            time.sleep(0.1)
        assert list(out.glob(".trtllm-build.tmp-*/config.json")), "trtllm-build never started writing"
    finally:
        os.killpg(rebuild.pid, signal.SIGKILL)
        rebuild.wait()
    assert engine_bytes(out) == before  # manifest, config.json and rank0.engine as they were
    assert read_manifest(out).engine == "tensorrt"
    monkeypatch.delenv("TRTLLM_STANDIN_PAUSE")
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT, force=True)
    assert json.loads((out / "config.json").read_text())["build_config"]["rebuilt"] is True
    assert not list(out.glob(".trtllm-build*")), "the killed run's staging folder was left"


def test_a_failed_tensorrt_rebuild_keeps_the_old_engine(hf, tmp_path, stand_in, monkeypatch):
    out = tmp_path / "engine"
    build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    before = engine_bytes(out)
    monkeypatch.setenv("TRTLLM_STANDIN_BUILD_CONFIG", json.dumps({"max_seq_len": 1024}))  # not the profile's
    with pytest.raises(ModelFileError, match="engine limits differ from the profile"):
        build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT, force=True)
    assert engine_bytes(out) == before and not list(out.glob(".trtllm-build*"))


def test_without_trtllm_build_the_error_names_the_container(hf, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "engine"
    with pytest.raises(DependencyError) as info:
        build_engine(TINY, model_dir=hf, output_dir=out, overrides=TENSORRT)
    assert "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3" in str(info.value)
    assert "\n" not in str(info.value) and not out.exists()


@pytest.mark.parametrize("with_trtllm", [True, False])
def test_engine_auto_builds_tensorrt_where_trtllm_build_is_and_torch_elsewhere(hf, tmp_path, monkeypatch, caplog,
                                                                              with_trtllm):
    """The 6B profiles say build.engine auto: NVIDIA's container gets a TensorRT engine, any other machine one for
    trtglm's runtime, and the log says which."""
    out = tmp_path / "engine"
    if with_trtllm:
        StandIn(tmp_path, monkeypatch).expect(expected_trtllm_argv(out))
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.INFO, logger="trtglm"):
        build_engine(TINY, model_dir=hf, output_dir=out, overrides={**TENSORRT, "build.engine": "auto"})
    expected = "tensorrt" if with_trtllm else "torch"
    assert read_manifest(out).engine == expected
    assert f"build.engine auto → {expected}" in caplog.text
    assert all(load_profile(p).build.engine == "auto" for p in (REPO / "configs").glob("chatglm3-6b-*.yaml"))


def test_trtllm07_target_prints_the_v071_command(tmp_path, capsys):
    build_engine(REPO / "configs" / "chatglm3-6b-int8-tp1.yaml", model_dir="/models/chatglm3-6b",
                 output_dir=tmp_path / "e", target="trtllm-0.7")
    assert shlex.split(capsys.readouterr().out) == [
        "python3", "examples/chatglm/build.py", "-m", "chatglm3_6b", "--model_dir", "/models/chatglm3-6b",
        "--world_size", "1", "--tp_size", "1", "--dtype", "float16", "--use_gpt_attention_plugin", "float16",
        "--use_gemm_plugin", "float16", "--use_weight_only", "--weight_only_precision", "int8",
        "--use_inflight_batching", "--paged_kv_cache", "--tokens_per_block", "128", "--remove_input_padding",
        "--enable_context_fmha", "--max_batch_size", "64", "--max_input_len", "4096", "--max_output_len", "4096",
        "--max_beam_width", "1", "--output_dir", str(tmp_path / "e")]
    assert not (tmp_path / "e").exists()


# --- torch engine and the manifest ----------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_engine(tmp_path_factory, fixture_dir) -> Path:
    return build_engine(TINY, output_dir=tmp_path_factory.mktemp("torch") / "tiny")


def test_torch_engine_for_the_tiny_profile(torch_engine, fixture_dir):
    manifest = read_manifest(torch_engine)
    raw = yaml.safe_load(TINY.read_text())
    assert manifest.engine == "torch" and manifest.engine_files == []
    assert manifest.limits == Limits(**{k: raw["build"][k] for k in ("max_batch_size", "max_input_len", "max_seq_len",
                                                                      "max_num_tokens", "max_beam_width")})
    assert manifest.dtype == raw["convert"]["dtype"] == checkpoint_dtype(torch_engine)
    assert manifest.profile["build"]["engine"] == "torch"
    assert manifest.sources["model_dir"] == str(fixture_dir)
    hf_config = json.loads((fixture_dir / "config.json").read_text())
    assert (manifest.model["num_layers"], manifest.model["vocab_size"]) == (
        hf_config["num_layers"], hf_config["padded_vocab_size"])
    assert manifest.tensorrt_llm_version is None
    tokenizer = manifest.tokenizer_dir
    assert (tokenizer / "tokenizer.model").read_bytes() == (fixture_dir / "tokenizer.model").read_bytes()


def test_manifest_tokenizer_facts_match_chatglm3s_id_layout(torch_engine, fixture_dir):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(fixture_dir / "tokenizer.model"))
    n = sp.vocab_size()
    assert (sp.id_to_piece(0), sp.id_to_piece(2)) == ("<unk>", "</s>")
    facts = read_manifest(torch_engine).tokenizer
    assert facts.special_ids == {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
    assert (facts.pad_id, facts.end_id, facts.vocab_size) == (0, 2, n + len(SPECIAL_TOKENS))
    assert facts.stop_ids == [2, n + SPECIAL_TOKENS.index("<|user|>"), n + SPECIAL_TOKENS.index("<|observation|>")]


def test_an_interrupted_rebuild_leaves_the_working_engine_as_it_was(tmp_path, monkeypatch):
    """`build-engine --force` with other conversion settings, stopped during the conversion (Ctrl-C, SIGTERM):
    the engine already there reads and loads as before, during and after."""
    from trtglm.convert import writer
    from trtglm.runtime.model import load_model

    out = build_engine(TINY, output_dir=tmp_path / "tiny")
    before = read_manifest(out)
    real = writer.convert_checkpoint

    def interrupted(hf, ckpt, **settings):
        assert read_manifest(out) == before  # serving from it goes on while the new checkpoint is made
        with pytest.raises(KeyboardInterrupt):
            with staged_output(Path(ckpt)):
                raise KeyboardInterrupt  # stopped halfway through writing the new checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "convert_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_engine(TINY, output_dir=out, overrides={"convert.dtype": "float16"}, force=True)
    assert read_manifest(out) == before and before.dtype != "float16"
    assert load_model(out / "checkpoint").config.vocab_size > 0
    monkeypatch.setattr(writer, "convert_checkpoint", real)
    rebuilt = read_manifest(build_engine(TINY, output_dir=out, overrides={"convert.dtype": "float16"}, force=True))
    assert rebuilt.dtype == "float16"


def test_existing_engine_needs_force_unless_up_to_date(torch_engine, tmp_path):
    manifest = (torch_engine / "trtglm.json").read_bytes()
    assert build_engine(TINY, output_dir=torch_engine) == torch_engine  # same profile and model: nothing to do
    assert (torch_engine / "trtglm.json").read_bytes() == manifest
    with pytest.raises(OutputExistsError, match="use --force"):
        build_engine(TINY, output_dir=torch_engine, overrides={"build.max_batch_size": 4})
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        build_engine(TINY, output_dir=foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"


def copy_engine(engine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(engine, tmp_path / "copy"))


@pytest.mark.parametrize("damage, message", [
    (lambda e: (e / "trtglm.json").unlink(), "trtglm.json: not found"),
    (lambda e: (e / "trtglm.json").write_text("{oops"), "not valid JSON"),
    (lambda e: _edit(e, lambda m: m.pop("limits")), "missing key limits"),
    (lambda e: _edit(e, lambda m: m.update(mapping=[1])), "mapping has the wrong type"),
    (lambda e: _edit(e, lambda m: m["tokenizer"].pop("end_id")), "tokenizer lacks end_id"),
    (lambda e: _edit(e, lambda m: m.update(engine="onnx")), "engine must be one of tensorrt, torch"),
    (lambda e: _edit(e, lambda m: m["limits"].update(max_seq_len="512")), "limits.max_seq_len has the wrong type"),
    (lambda e: _edit(e, lambda m: m["mapping"].update(world_size=2)), "mapping.world_size is 2, but tp × pp = 1 × 1"),
    (lambda e: _edit(e, lambda m: m.update(format_version=99)), "rebuild with this trtglm"),
    (lambda e: _edit(e, lambda m: m.update(engine_files=["rank0.engine"])), "rank0.engine, which is missing"),
    (lambda e: shutil.rmtree(e / "checkpoint"), "which is missing"),
])
def test_read_manifest_rejects_damage_in_one_line(torch_engine, tmp_path, damage, message):
    engine = copy_engine(torch_engine, tmp_path)
    assert read_manifest(engine).engine_dir == engine.resolve()
    damage(engine)
    with pytest.raises(ModelFileError) as info:
        read_manifest(engine)
    assert message in str(info.value) and "\n" not in str(info.value)


def _edit(engine: Path, change) -> None:
    path = engine / "trtglm.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_read_manifest_resolves_paths(torch_engine):
    manifest = read_manifest(torch_engine)
    assert manifest.checkpoint_dir == torch_engine.resolve() / "checkpoint"
    assert manifest.tokenizer_dir == torch_engine.resolve() / "tokenizer"


# --- through the command line ---------------------------------------------------------------------


def test_cli_build_engine_with_set_and_force(tmp_path, fixture_dir):
    out = tmp_path / "tiny"
    proc = run_cli("build-engine", "--config", "configs/tiny.yaml", "--output-dir", out,
                   "--set", "build.max_batch_size=4", "--set=build.max_num_tokens=1024")
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(out).limits.max_batch_size == 4
    built = (out / "trtglm.json").read_bytes()
    same = run_cli("build-engine", "--config", "configs/tiny.yaml", "--output-dir", out,
                   "--set", "build.max_batch_size=4", "--set=build.max_num_tokens=1024")
    assert same.returncode == 0 and "is up to date" in same.stderr, same.stderr
    assert (out / "trtglm.json").read_bytes() == built  # nothing was rebuilt
    again = run_cli("build-engine", "--config", "configs/tiny.yaml", "--output-dir", out)
    assert again.returncode == 4 and "--force" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    forced = run_cli("build-engine", "--config", "configs/tiny.yaml", "--output-dir", out, "--force")
    assert forced.returncode == 0 and "reusing checkpoint" in forced.stderr  # limits are not conversion settings
    assert read_manifest(out).limits.max_batch_size == 8


def test_cli_dry_run_and_profile_errors(tmp_path, fixture_dir):
    dry = run_cli("build-engine", "--config", "configs/chatglm3-6b-fp16-tp2.yaml", "--model-dir", "/models/x",
                  "--output-dir", tmp_path / "e", "--set", "build.engine=tensorrt", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "trtllm-build --checkpoint_dir" in dry.stdout and "--tp-size 2" in dry.stdout
    bad = run_cli("build-engine", "--config", "configs/tiny.yaml", "--set", "build.max_input_len=600")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "build.max_input_len (600) must be < build.max_seq_len (512)" in bad.stderr


def test_fp8_torch_engines_are_not_warmed_up_on_gpus_without_fp8(hf, tmp_path, monkeypatch, capsys):
    """build-engine on a GPU warms a torch engine up; an FP8 one on a GPU without FP8 tensor cores is left whole and
    cold (it runs on Ada and Hopper GPUs), not failed."""
    import torch

    from trtglm.cli.engine import warmup_applies

    plain = build_engine(TINY, model_dir=hf, output_dir=tmp_path / "bf16", overrides={"convert.dtype": "bfloat16"})
    fp8 = build_engine(TINY, model_dir=hf, output_dir=tmp_path / "fp8",
                       overrides={"convert.dtype": "bfloat16", "convert.fp8": True})
    for name, value in (("is_available", lambda: True), ("current_device", lambda: 0),
                        ("get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.delenv("TRTGLM_DEVICE", raising=False)
    for capability, fp8_warmed in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert (warmup_applies(plain), warmup_applies(fp8)) == (True, fp8_warmed)
    assert "not warmed up: an FP8 engine, and NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8" in \
        capsys.readouterr().out
