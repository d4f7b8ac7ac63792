"""`trtglm patch-repo`: trtglm's template and NVIDIA's v0.7.1 / v0.19.0 layouts rendered for an
engine folder, checked against the values trtglm.json and the profile hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from tritonclient.grpc import model_config_pb2

from conftest import REPO, run_cli
from support.cli_calls import patch_repo
from support.repos import (HISTORY_CHAT, LIMITS, MODELS, TEMPLATE, engine_vocab, ensemble_step, make_engine, parameter,
                               read_configs, template_copy, tree, upstream_copy)
from trtglm.cli.repo import patch_repo as patch_repo_command
from trtglm.errors import ModelFileError, OutputExistsError, UsageError
from trtglm.repo import check_repo

PLACEHOLDER = re.compile(r"\$\{\w+\}")
TRTGLM_MODEL_FILES = ("preprocessing/1/model.py", "postprocessing/1/model.py", "tensorrt_llm_bls/1/model.py",
                      "chatglm3-6b/1/model.py")


def batch_sizes(configs: dict) -> set[int]:
    """The pipeline's max_batch_size values; the history model is always 0 (its clients' shapes), never decoupled."""
    history = configs[HISTORY_CHAT]
    assert history.max_batch_size == 0 and not history.model_transaction_policy.decoupled
    assert parameter(history, "decoupled_mode") == str(configs["tensorrt_llm"].model_transaction_policy.decoupled
                                                       ).lower()
    return {c.max_batch_size for name, c in configs.items() if name != HISTORY_CHAT}


@pytest.fixture
def tok(fixture_dir):
    return fixture_dir


@pytest.fixture
def trt_engine(tmp_path, tok):
    return make_engine(tmp_path, "tensorrt", tok)


def code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.lstrip().startswith("#")]


def assert_filled(repo):
    for path in repo.rglob("config.pbtxt"):
        leftover = [m for line in code_lines(path.read_text()) for m in PLACEHOLDER.findall(line)]
        assert not leftover, f"{path}: {leftover}"


# --- trtglm's template ---------------------------------------------------------------------------


def test_tensorrt_engine_fills_every_placeholder_from_the_manifest(tmp_path, trt_engine, tok):
    repo = patch_repo(trt_engine, None, tmp_path / "repo")
    assert_filled(repo)
    configs = read_configs(repo)  # parses with Triton's own protobuf
    assert list(configs) == list(MODELS) and batch_sizes(configs) == {LIMITS["max_batch_size"]}
    llm = configs["tensorrt_llm"]
    assert llm.backend == "tensorrtllm"
    assert llm.model_transaction_policy.decoupled is True  # ServeSection's default
    assert parameter(llm, "gpt_model_path") == str(trt_engine.resolve())
    assert parameter(llm, "gpt_model_type") == "inflight_fused_batching"
    assert parameter(llm, "batch_scheduler_policy") == "guaranteed_no_evict"
    assert parameter(llm, "kv_cache_free_gpu_mem_fraction") == "0.9"
    assert parameter(llm, "max_beam_width") == "1"
    assert parameter(llm, "exclude_input_in_output") == "true"
    for model in ("preprocessing", "tensorrt_llm_bls", HISTORY_CHAT):
        assert parameter(configs[model], "max_input_len") == str(LIMITS["max_input_len"])
        assert parameter(configs[model], "max_seq_len") == str(LIMITS["max_seq_len"])
        assert parameter(configs[model], "vocab_size") == str(engine_vocab(tok))
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls", HISTORY_CHAT):
        assert parameter(configs[model], "tokenizer_dir") == str(tok.resolve())
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled is True
    files = tree(repo)
    assert "tensorrt_llm/1" in files and "ensemble/1" in files
    assert not any(name.startswith("tensorrt_llm/1/") for name in files)  # the C++ backend needs no model.py
    for name in TRTGLM_MODEL_FILES:
        assert files[name] == (TEMPLATE / name).read_bytes()
    assert check_repo(repo) == []


def test_profile_serve_section_reaches_the_configs(tmp_path, tok):
    serve = {"decoupled": False, "preprocessing_instances": 3, "bls_instances": 2, "max_queue_delay_microseconds": 250,
             "batch_scheduler_policy": "max_utilization", "kv_cache_free_gpu_mem_fraction": 0.5}
    repo = patch_repo(make_engine(tmp_path, "tensorrt", tok, serve=serve), tok, tmp_path / "repo")
    configs = read_configs(repo)
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled is False
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled is False
    assert configs["preprocessing"].instance_group[0].count == 3
    assert configs["tensorrt_llm_bls"].instance_group[0].count == 2
    assert configs["tensorrt_llm"].dynamic_batching.max_queue_delay_microseconds == 250
    assert parameter(configs["tensorrt_llm"], "batch_scheduler_policy") == "max_utilization"
    assert parameter(configs["tensorrt_llm"], "kv_cache_free_gpu_mem_fraction") == "0.5"


def test_bls_instances_0_gives_one_per_sequence_the_engine_runs_at_once(tmp_path, tok):
    """Each BLS (and history) instance answers one request at a time (backend/bls.py)."""
    engine = make_engine(tmp_path, "torch", tok, serve={"bls_instances": 0}, limits={"max_batch_size": 12})
    configs = read_configs(patch_repo(engine, tok, tmp_path / "repo"))
    assert configs["tensorrt_llm_bls"].instance_group[0].count == 12
    assert configs[HISTORY_CHAT].instance_group[0].count == 12


def test_an_engine_built_before_a_serve_key_existed_renders_with_its_default(tmp_path, tok):
    """A serving setting added to the profiles later needs no rebuild: the engine's recorded profile lacks it."""
    engine = make_engine(tmp_path, "torch", tok)
    manifest = json.loads((engine / "trtglm.json").read_text())
    del manifest["profile"]["serve"]["max_return_sequences"]
    (engine / "trtglm.json").write_text(json.dumps(manifest))
    configs = read_configs(patch_repo(engine, tok, tmp_path / "repo"))
    assert parameter(configs["tensorrt_llm"], "max_return_sequences") == "8"
    assert parameter(configs["tensorrt_llm_bls"], "max_return_sequences") == "8"


def test_torch_engine_uses_the_python_backend_and_its_model_file(tmp_path, tok):
    template = template_copy(tmp_path)
    repo = patch_repo(make_engine(tmp_path, "torch", tok), tok, tmp_path / "repo", template=template)
    assert read_configs(repo)["tensorrt_llm"].backend == "python"
    assert (repo / "tensorrt_llm/1/model.py").read_bytes() == (template / "tensorrt_llm/1/model.py").read_bytes()
    assert check_repo(repo) == []


WHOLE_STREAM = {"generated_ids": "GENERATED_IDS", "is_final": "IS_FINAL"}  # tensorrt_llm -> postprocessing


def assert_streams_through_the_ensemble(configs: dict, streams: bool) -> None:
    """With trtglm's runtime `stream` reaches tensorrt_llm and postprocessing reads every id so far; with
    NVIDIA's backend `stream` goes to preprocessing (which refuses it) and nothing else changes."""
    ensemble = configs["ensemble"]
    pre, llm, post = (ensemble_step(ensemble, m) for m in ("preprocessing", "tensorrt_llm", "postprocessing"))
    declared = {t.name: t for t in configs["tensorrt_llm"].output}
    optional = {t.name: t.optional for t in configs["postprocessing"].input}
    if streams:
        assert llm.input_map["streaming"] == "stream" and "STREAM" not in pre.input_map
        for output, input_name in WHOLE_STREAM.items():
            assert post.input_map[input_name] == llm.output_map[output]
            assert output in declared and optional[input_name] is True
        assert [declared["generated_ids"].data_type, declared["is_final"].data_type] == [
            model_config_pb2.TYPE_INT32, model_config_pb2.TYPE_BOOL]
        assert configs["postprocessing"].dynamic_batching.preserve_ordering
    else:
        assert pre.input_map["STREAM"] == "stream" and "streaming" not in llm.input_map
        assert not set(WHOLE_STREAM) & set(declared) and not set(WHOLE_STREAM.values()) & set(post.input_map)


def test_torch_engine_streams_through_the_ensemble_and_tensorrt_does_not(tmp_path, trt_engine, tok):
    torch_repo = patch_repo(make_engine(tmp_path, "torch", tok), tok, tmp_path / "torch", template=template_copy(tmp_path))
    assert_streams_through_the_ensemble(read_configs(torch_repo), streams=True)
    trt_repo = patch_repo(trt_engine, tok, tmp_path / "trt")
    assert_streams_through_the_ensemble(read_configs(trt_repo), streams=False)
    for repo, other in ((torch_repo, "tensorrtllm"), (trt_repo, "python")):
        assert not any(f"# only with backend {other}" in (repo / m / "config.pbtxt").read_text() for m in MODELS)


def test_torch_engine_without_a_runtime_model_file_is_refused(tmp_path, tok):
    template = template_copy(tmp_path)
    (template / "tensorrt_llm/1/model.py").unlink()
    with pytest.raises(UsageError, match=r"tensorrt_llm/1/model\.py: missing"):
        patch_repo(make_engine(tmp_path, "torch", tok), tok, tmp_path / "repo", template=template)
    assert not (tmp_path / "repo").exists()


def test_rendering_is_byte_identical(tmp_path, trt_engine, tok):
    first = tree(patch_repo(trt_engine, tok, tmp_path / "a"))
    second = tree(patch_repo(trt_engine, tok, tmp_path / "b"))
    again = tree(patch_repo(trt_engine, tok, tmp_path / "a", force=True))
    assert first == second == again


def test_existing_output_needs_force(tmp_path, trt_engine):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep").write_text("user data")
    with pytest.raises(OutputExistsError):
        patch_repo(trt_engine, None, out)
    assert (out / "keep").read_text() == "user data"
    patch_repo(trt_engine, None, out, force=True)
    assert not (out / "keep").exists() and (out / "ensemble/config.pbtxt").is_file()


def test_set_overrides_a_placeholder(tmp_path, trt_engine):
    repo = patch_repo(trt_engine, None, tmp_path / "repo", sets={"triton_max_batch_size": "4",
                                                                  "kv_cache_free_gpu_mem_fraction": "0.7"})
    configs = read_configs(repo)
    assert batch_sizes(configs) == {4}
    assert parameter(configs["tensorrt_llm"], "kv_cache_free_gpu_mem_fraction") == "0.7"


@pytest.mark.parametrize("sets, message", [
    ({"max_batchsize": "4"}, r"--set max_batchsize: not a placeholder of the trtglm template"),
    ({"triton_max_batch_size": "64"}, r"max_batch_size 64 exceeds the engine's 8"),
    ({"triton_max_batch_size": "8 }"}, r"\$\{triton_max_batch_size\} stands outside quotes"),
    ({"tokenizer_dir": "${oops}"}, r"config\.pbtxt:\d+: placeholder \$\{oops\} is left unfilled"),
])
def test_bad_set_is_one_line_usage_error_and_writes_nothing(tmp_path, trt_engine, sets, message):
    with pytest.raises(UsageError, match=message) as error:
        patch_repo(trt_engine, None, tmp_path / "repo", sets=sets)
    assert "\n" not in str(error.value)
    assert [p.name for p in tmp_path.iterdir()] == [trt_engine.name]  # no output, no temporary folder


def test_unknown_placeholder_in_a_template_names_file_and_placeholder(tmp_path, trt_engine):
    template = template_copy(tmp_path)
    config = template / "postprocessing/config.pbtxt"
    config.write_text(config.read_text().replace('"${tokenizer_dir}"', '"${tokenizer_path}"'))
    with pytest.raises(UsageError, match=r"postprocessing/config\.pbtxt has \$\{tokenizer_path\}"):
        patch_repo(trt_engine, None, tmp_path / "repo", template=template)


def test_tokenizer_that_does_not_match_the_engine_is_refused(tmp_path, tok):
    engine = make_engine(tmp_path, "tensorrt", tok)
    manifest = (engine / "trtglm.json").read_text().replace('"end_id": 2', '"end_id": 5')
    (engine / "trtglm.json").write_text(manifest)
    with pytest.raises(UsageError, match="end_id is 2, but the engine was built with 5"):
        patch_repo(engine, tok, tmp_path / "repo")


def test_missing_engine_manifest_is_a_model_file_error(tmp_path, tok):
    with pytest.raises(ModelFileError, match="trtglm.json"):
        patch_repo(tmp_path, tok, tmp_path / "repo")


def test_build_engine_output_renders(tmp_path, fixture_dir):
    """The engine folder `trtglm build-engine` writes for configs/tiny.yaml (a torch engine)."""
    from support.cli_calls import build_engine

    engine = build_engine(REPO / "configs" / "tiny.yaml", model_dir=fixture_dir, output_dir=tmp_path / "engine")
    profile = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    repo = patch_repo(engine, None, tmp_path / "repo", template=template_copy(tmp_path))
    configs = read_configs(repo)
    assert configs["tensorrt_llm"].backend == "python"
    assert batch_sizes(configs) == {profile["build"]["max_batch_size"]}
    assert parameter(configs["preprocessing"], "max_input_len") == str(profile["build"]["max_input_len"])
    vocab = json.loads((tmp_path / "engine" / "checkpoint" / "config.json").read_text())["vocab_size"]
    assert parameter(configs["preprocessing"], "vocab_size") == str(vocab)
    tokenizer = parameter(configs["postprocessing"], "tokenizer_dir")
    assert (Path(tokenizer) / "tokenizer.model").read_bytes() == (fixture_dir / "tokenizer.model").read_bytes()
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled is profile["serve"]["decoupled"]


# --- NVIDIA's layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v0.7.1", "v0.19.0"])
def test_upstream_copy_is_filled_and_gets_trtglm_models(tmp_path, trt_engine, tok, version):
    template = upstream_copy(tmp_path, version)
    repo = patch_repo(trt_engine, tok, tmp_path / "repo", template=template)
    assert_filled(repo)
    configs = read_configs(repo)
    assert batch_sizes(configs) == {LIMITS["max_batch_size"]}
    llm = configs["tensorrt_llm"]
    assert llm.backend == "tensorrtllm"
    assert llm.model_transaction_policy.decoupled is True
    assert parameter(llm, "gpt_model_path") == str(trt_engine.resolve())
    assert parameter(llm, "gpt_model_type") == "inflight_fused_batching"
    assert parameter(llm, "batch_scheduler_policy") == "guaranteed_no_evict"
    assert parameter(llm, "kv_cache_free_gpu_mem_fraction") == "0.9"
    assert parameter(llm, "exclude_input_in_output") == "true"
    assert "max_tokens_in_paged_kv_cache" not in llm.parameters  # left to the backend's default
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled is True
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls", HISTORY_CHAT):
        assert parameter(configs[model], "tokenizer_dir") == str(tok.resolve())
        # the BLS and history models: one instance per sequence the engine runs at once
        assert configs[model].instance_group[0].count == (1 if "processing" in model else LIMITS["max_batch_size"])
    assert parameter(configs["preprocessing"], "max_input_len") == str(LIMITS["max_input_len"])
    files = tree(repo)
    for name in TRTGLM_MODEL_FILES:
        assert files[name] == (TEMPLATE / name).read_bytes()
    assert files["tensorrt_llm/config.pbtxt"].startswith(b"# Copyright")  # NVIDIA's notice is kept
    assert check_repo(repo) == []


@pytest.mark.parametrize("version", ["v0.7.1", "v0.19.0"])
def test_upstream_ensemble_takes_end_and_pad_ids_from_preprocessing_and_does_not_stream(tmp_path, trt_engine,
                                                                                        version):
    repo = patch_repo(trt_engine, None, tmp_path / "repo", template=upstream_copy(tmp_path, version))
    configs = read_configs(repo)
    ensemble = configs["ensemble"]
    pre, llm = ensemble_step(ensemble, "preprocessing"), ensemble_step(ensemble, "tensorrt_llm")
    assert llm.input_map["end_id"] == pre.output_map["OUT_END_ID"]
    assert llm.input_map["pad_id"] == pre.output_map["OUT_PAD_ID"]
    assert pre.input_map["END_ID"] == "end_id" and pre.input_map["PAD_ID"] == "pad_id"
    assert {"END_ID", "PAD_ID", "STREAM"} <= {t.name for t in configs["preprocessing"].input}
    assert_streams_through_the_ensemble(configs, streams=False)


@pytest.mark.parametrize("version", ["v0.7.1", "v0.19.0"])
def test_upstream_copy_for_trtglms_runtime_streams_through_the_ensemble(tmp_path, tok, version):
    engine = make_engine(tmp_path, "torch", tok)
    template = upstream_copy(tmp_path, version)
    (template / "tensorrt_llm" / "1").mkdir(exist_ok=True)
    (template / "tensorrt_llm" / "1" / "model.py").write_text("from trtglm.backend.triton_model import TritonPythonModel\n")
    repo = patch_repo(engine, tok, tmp_path / "repo", template=template)
    configs = read_configs(repo)
    assert configs["tensorrt_llm"].backend == "python"
    assert_streams_through_the_ensemble(configs, streams=True)
    assert check_repo(repo) == []


def test_v0_19_unset_parameters_are_removed_and_set_ones_kept(tmp_path, trt_engine):
    repo = patch_repo(trt_engine, None, tmp_path / "repo", template=upstream_copy(tmp_path, "v0.19.0"),
                      sets={"gpu_device_ids": "0,1", "logits_datatype": "TYPE_FP16"})
    configs = read_configs(repo)
    llm = configs["tensorrt_llm"]
    assert parameter(llm, "gpu_device_ids") == "0,1"
    assert not {"lora_prefetch_dir", "participant_ids", "medusa_choices", "decoding_mode"} & set(llm.parameters)
    assert parameter(llm, "executor_worker_path").endswith("trtllmExecutorWorker")  # not a placeholder: kept
    logits = {t.name: t.data_type for t in configs["ensemble"].output}
    assert logits["context_logits"] == logits["generation_logits"] == model_config_pb2.TYPE_FP16


def test_v0_19_placeholder_inside_other_text_is_left_unfilled_and_refused(tmp_path, trt_engine):
    template = upstream_copy(tmp_path, "v0.19.0")
    config = template / "tensorrt_llm/config.pbtxt"
    config.write_text(config.read_text().replace('"${lora_prefetch_dir}"', '"/loras/${lora_prefetch_dir}"'))
    with pytest.raises(UsageError, match=r"tensorrt_llm/config\.pbtxt.*\$\{lora_prefetch_dir\} is left unfilled"):
        patch_repo(trt_engine, None, tmp_path / "repo", template=template)


def test_upstream_set_key_of_the_other_version_is_refused(tmp_path, trt_engine):
    with pytest.raises(UsageError, match="--set lora_prefetch_dir: not a placeholder of the v0.7.1 template"):
        patch_repo(trt_engine, None, tmp_path / "repo", template=upstream_copy(tmp_path, "v0.7.1"),
                   sets={"lora_prefetch_dir": "/x"})


def test_unrecognised_layout_is_refused(tmp_path, trt_engine):
    template = upstream_copy(tmp_path, "v0.7.1")
    (template / "tensorrt_llm_bls/config.pbtxt").unlink()
    with pytest.raises(UsageError, match=r"no tensorrt_llm_bls/config\.pbtxt"):
        patch_repo(trt_engine, None, tmp_path / "repo", template=template)


# --- the command ---------------------------------------------------------------------------------


def test_command_takes_set_pairs_and_check_reports(tmp_path, trt_engine, capsys):
    out = tmp_path / "repo"
    patch_repo_command(engine_dir=str(trt_engine), output_repo=str(out), set=["triton_max_batch_size=2", "max_queue_size=5"])
    assert read_configs(out)["tensorrt_llm"].dynamic_batching.default_queue_policy.max_queue_size == 5
    patch_repo_command(check=str(out))
    config = out / "preprocessing/config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 2", "max_batch_size: 9"))
    with pytest.raises(ModelFileError, match="1 problem"):
        patch_repo_command(check=str(out))
    assert "preprocessing/config.pbtxt: max_batch_size 9 exceeds the engine's 8" in capsys.readouterr().err




def test_cli_renders_checks_and_exits_with_typed_codes(tmp_path, trt_engine):
    out = tmp_path / "repo"
    proc = run_cli("patch-repo", "--engine-dir", trt_engine, "--output-repo", out,
                   "--set", "triton_max_batch_size=4", "--set", "max_queue_size=3")
    assert proc.returncode == 0, proc.stderr
    configs = read_configs(out)
    assert configs["ensemble"].max_batch_size == 4
    assert configs["tensorrt_llm"].dynamic_batching.default_queue_policy.max_queue_size == 3
    assert run_cli("patch-repo", "--check", out).returncode == 0
    proc = run_cli("patch-repo", "--engine-dir", trt_engine, "--output-repo", out)
    assert proc.returncode == 4 and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("patch-repo", "--engine-dir", trt_engine, "--output-repo", tmp_path / "b", "--set", "nope=1")
    assert proc.returncode == 2 and "--set nope" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    (out / "postprocessing/1/model.py").unlink()
    proc = run_cli("patch-repo", "--check", out)
    assert proc.returncode == 3
    assert "postprocessing/1/model.py: missing (python backend)" in proc.stderr.splitlines()


@pytest.mark.parametrize("version", [None, "v0.7.1", "v0.19.0"])
def test_the_engines_chatglm_version_reaches_every_model_that_prompts(tmp_path, tok, version):
    """A ChatGLM2 engine's models prompt in ChatGLM2's format; an engine that does not say is ChatGLM3's."""
    template = None if version is None else upstream_copy(tmp_path, version)
    prompting = ("preprocessing", "tensorrt_llm_bls", HISTORY_CHAT)
    for said, expected in (({"chatglm_version": "chatglm2"}, "chatglm2"), ({}, "chatglm3")):
        engine = make_engine(tmp_path / expected, "tensorrt", tok, model=said)
        repo = patch_repo(engine, None, tmp_path / expected / "repo", template=template)
        configs = read_configs(repo)
        assert {model: parameter(configs[model], "chatglm_version") for model in prompting} == dict.fromkeys(
            prompting, expected)
