"""`trtglm patch-repo --check`: problems planted in a rendered repository are each reported."""

from __future__ import annotations

import json
import re
import string

import pytest
from support.cli_calls import patch_repo
from support.repos import make_engine, template_copy, upstream_copy

from trtglm.repo import check_repo


@pytest.fixture
def repo(tmp_path, fixture_dir):
    return patch_repo(make_engine(tmp_path, "tensorrt", fixture_dir), fixture_dir, tmp_path / "repo")


def edit(repo, model: str, old: str, new: str, count: int = 1) -> None:
    path = repo / model / "config.pbtxt"
    text = path.read_text()
    assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new))


def test_rendered_repository_has_no_problems(repo):
    assert check_repo(repo) == []


@pytest.mark.parametrize("model, old, new, expected", [
    ("ensemble", 'model_name: "postprocessing"', 'model_name: "postprocess"',
     "ensemble/config.pbtxt: step postprocess: no such model in the repository"),
    ("postprocessing", '{ name: "OUTPUT", data_type: TYPE_STRING, dims: [ -1 ] }',
     '{ name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] }',
     "ensemble/config.pbtxt: step postprocessing: output_map names OUTPUT, which it does not declare"),
    ("ensemble", 'input_map { key: "input_lengths", value: "_REQUEST_INPUT_LEN" }', "",
     "ensemble/config.pbtxt: step tensorrt_llm: required input input_lengths is not mapped"),
    ("ensemble", '{ key: "SEQUENCE_LENGTH", value: "_SEQUENCE_LENGTH" }', '{ key: "SEQUENCE_LENGTH", value: "_SEQ" }',
     "ensemble/config.pbtxt: step postprocessing: input SEQUENCE_LENGTH reads _SEQ, which no ensemble input or step "
     "provides"),
    ("ensemble", '{ name: "max_tokens", data_type: TYPE_INT32,', '{ name: "max_tokens", data_type: TYPE_INT64,',
     "ensemble/config.pbtxt: step preprocessing: input REQUEST_OUTPUT_LEN is TYPE_INT32 but max_tokens is TYPE_INT64"),
    ("preprocessing", "max_batch_size: 8", "max_batch_size: 16",
     "preprocessing/config.pbtxt: max_batch_size 16 exceeds the engine's 8"),
    ("ensemble", "max_batch_size: 8", "max_batch_size: 16",
     "ensemble/config.pbtxt: max_batch_size 16 exceeds preprocessing's 8"),
    ("tensorrt_llm_bls", "decoupled: true", "decoupled: false",
     "tensorrt_llm_bls/config.pbtxt: decoupled is false, but tensorrt_llm's is true"),
    ("tensorrt_llm", "decoupled: true", "decoupled: false",
     "tensorrt_llm/config.pbtxt: decoupled is false, but the profile's serve.decoupled is true"),
    ("tensorrt_llm", 'backend: "tensorrtllm"', 'backend: "python"',
     "tensorrt_llm/config.pbtxt: backend is 'python', but a tensorrt engine needs 'tensorrtllm'"),
    ("tensorrt_llm", '"max_beam_width", value { string_value: "1" }', '"max_beam_width", value { string_value: "4" }',
     "tensorrt_llm/config.pbtxt: parameter max_beam_width 4 exceeds the engine's 1"),
    ("preprocessing", '"max_input_len", value { string_value: "384" }',
     '"max_input_len", value { string_value: "385" }',
     "preprocessing/config.pbtxt: parameter max_input_len 385 exceeds the engine's 384"),
    ("tensorrt_llm", '{ string_value: "true" } }', '{ string_value: "false" } }',
     "tensorrt_llm/config.pbtxt: exclude_input_in_output must be true"),
    ("postprocessing", "max_batch_size: 8", "max_batch_size: ${triton_max_batch_size}",
     "postprocessing/config.pbtxt: placeholder ${triton_max_batch_size} is left unfilled"),
    ("postprocessing", "dynamic_batching { preserve_ordering: true }", "dynamic_batching { frobnicate: 1 }",
     "postprocessing/config.pbtxt: does not parse"),
    ("ensemble", 'input_map { key: "beam_width", value: "beam_width" }', "",
     "ensemble/config.pbtxt: input beam_width is read by no step"),
    ("chatglm3-6b", 'max_batch_size: 0', 'max_batch_size: 0\nmodel_transaction_policy { decoupled: true }',
     "chatglm3-6b/config.pbtxt: decoupled must be false (its clients send plain infer requests)"),
    ("chatglm3-6b", '"decoupled_mode", value { string_value: "true" }',
     '"decoupled_mode", value { string_value: "false" }',
     "chatglm3-6b/config.pbtxt: parameter decoupled_mode is 'false', but tensorrt_llm's decoupled is true"),
    ("chatglm3-6b", '"max_seq_len", value { string_value: "512" }', '"max_seq_len", value { string_value: "513" }',
     "chatglm3-6b/config.pbtxt: parameter max_seq_len 513 exceeds the engine's 512"),
])
def test_planted_problem_is_reported(repo, model, old, new, expected):
    edit(repo, model, old, new)
    problems = check_repo(repo)
    assert any(p.startswith(expected) for p in problems), problems


def test_streaming_through_the_ensemble_is_a_problem(repo):
    edit(repo, "ensemble", 'input_map { key: "STREAM", value: "stream" }', "")
    edit(repo, "ensemble", 'input_map { key: "beam_width", value: "beam_width" }',
         'input_map { key: "beam_width", value: "beam_width" }\n      input_map { key: "streaming", value: "stream" }')
    assert any("streams tensorrt_llm's output into postprocessing" in p for p in check_repo(repo))


def test_ensemble_streams_only_when_postprocessing_reads_the_whole_stream(tmp_path, fixture_dir):
    repo = patch_repo(make_engine(tmp_path, "torch", fixture_dir), fixture_dir, tmp_path / "repo",
                      template=template_copy(tmp_path))
    assert check_repo(repo) == []  # trtglm's runtime streams through the ensemble
    edit(repo, "ensemble", 'input_map { key: "IS_FINAL", value: "_IS_FINAL" }', "")
    edit(repo, "ensemble", 'output_map { key: "is_final", value: "_IS_FINAL" }', "")
    assert any("streams tensorrt_llm's output into postprocessing" in p for p in check_repo(repo))


def test_generated_ids_on_nvidias_backend_is_a_problem(repo):
    edit(repo, "tensorrt_llm", "output [", 'output { name: "generated_ids", data_type: TYPE_INT32, dims: [ -1, -1 ] }'
                                          "\noutput [")
    assert "tensorrt_llm/config.pbtxt: declares generated_ids, which only trtglm's runtime (backend python) " \
           "produces" in check_repo(repo)


def test_step_mixing_decoupled_and_earlier_tensors_is_a_problem(repo):
    """Triton refuses this ensemble (seen with tritonserver 2.51): postprocessing reads the decoupled engine's ids
    and a preprocessing output."""
    edit(repo, "postprocessing", '{ name: "SEQUENCE_LENGTH", data_type: TYPE_INT32, dims: [ -1 ] }',
         '{ name: "SEQUENCE_LENGTH", data_type: TYPE_INT32, dims: [ -1 ] },\n'
         '  { name: "PROMPT_LEN", data_type: TYPE_INT32, dims: [ 1 ], optional: true }')
    edit(repo, "ensemble", 'input_map { key: "SEQUENCE_LENGTH", value: "_SEQUENCE_LENGTH" }',
         'input_map { key: "SEQUENCE_LENGTH", value: "_SEQUENCE_LENGTH" }\n'
         '      input_map { key: "PROMPT_LEN", value: "_REQUEST_INPUT_LEN" }')
    problems = check_repo(repo)
    assert any(re.match(r"ensemble/config\.pbtxt: step postprocessing reads tensors from different decoupled "
                        r"origins", p) for p in problems), problems


def test_missing_python_model_file_and_foreign_model_file(repo):
    (repo / "postprocessing/1/model.py").unlink()
    (repo / "preprocessing/1/model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    problems = check_repo(repo)
    assert "postprocessing/1/model.py: missing (python backend)" in problems
    assert any(p.startswith("preprocessing/1/model.py: not trtglm's") for p in problems)


def test_missing_model_and_version_folder(repo):
    (repo / "tensorrt_llm_bls/config.pbtxt").unlink()
    (repo / "ensemble/1").rmdir()
    problems = check_repo(repo)
    assert "tensorrt_llm_bls/config.pbtxt: missing" in problems
    assert "ensemble: no version folder (e.g. ensemble/1/)" in problems


def test_world_size_must_be_tp_times_pp(tmp_path, fixture_dir):
    engine = make_engine(tmp_path, "tensorrt", fixture_dir, serve={"world_size": 2})
    with pytest.raises(Exception, match=r"profile serve.world_size is 2, but tp × pp = 1 × 1"):
        patch_repo(engine, None, tmp_path / "repo")


def test_engine_folder_without_trtglm_json_is_read_from_its_config_json(repo, tmp_path):
    """An engine built outside trtglm: limits and mapping from TensorRT-LLM's config.json."""
    engine = tmp_path / "foreign"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({
        "build_config": {"max_batch_size": 4, "max_input_len": 384, "max_seq_len": 512, "max_beam_width": 1},
        "pretrained_config": {"mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}}}))
    edit(repo, "tensorrt_llm", str((tmp_path / "engine-tensorrt").resolve()), str(engine), count=1)
    problems = check_repo(repo)
    assert "tensorrt_llm/config.pbtxt: max_batch_size 8 exceeds the engine's 4" in problems
    assert not any("world_size" in p for p in problems)


def test_an_engine_folder_that_is_gone_or_not_an_engine_is_reported(repo, tmp_path):
    """What launch refuses the check reports, in the words of the reader they share (model_repository)."""
    engine = str((tmp_path / "engine-tensorrt").resolve())
    edit(repo, "tensorrt_llm", engine, "/no/such/engine")
    assert check_repo(repo) == ["tensorrt_llm/config.pbtxt: engine folder /no/such/engine does not exist"]
    empty = tmp_path / "empty"
    empty.mkdir()
    edit(repo, "tensorrt_llm", "/no/such/engine", str(empty))
    [problem] = check_repo(repo)
    assert problem.startswith("tensorrt_llm/config.pbtxt: gpt_model_path: ") and \
        f"engine folder {empty} has neither trtglm.json nor config.json" in problem


@pytest.mark.parametrize("version", ["v0.7.1", "v0.19.0"])
def test_upstream_layout_filled_the_nvidia_way_is_reported(tmp_path, fixture_dir, version):
    """NVIDIA's layout filled with string.Template.safe_substitute as its fill_template.py does, with NVIDIA's
    model files: what breaks ChatGLM3 there is named."""
    engine = make_engine(tmp_path, "tensorrt", fixture_dir)
    template = upstream_copy(tmp_path, version)
    values = {"triton_max_batch_size": "8", "decoupled_mode": "true", "max_queue_delay_microseconds": "0",
              "max_queue_size": "0", "logits_datatype": "TYPE_FP32", "encoder_input_features_data_type": "TYPE_FP16",
              "preprocessing_instance_count": "1", "postprocessing_instance_count": "1", "bls_instance_count": "1",
              "triton_backend": "tensorrtllm", "engine_dir": str(engine), "tokenizer_dir": str(fixture_dir),
              "max_beam_width": "1", "accumulate_tokens": "false", "tokenizer_type": "auto",
              "add_special_tokens": "true", "skip_special_tokens": "true"}
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls", "tensorrt_llm", "ensemble"):
        config = template / model / "config.pbtxt"
        config.write_text(string.Template(config.read_text()).safe_substitute(values))
        (template / model / "1").mkdir(exist_ok=True)
        nvidia_model = template / model / "1" / "model.py"
        if model not in ("tensorrt_llm", "ensemble") and not nvidia_model.exists():  # v0.7.1's set has configs only
            nvidia_model.write_text("from transformers import AutoTokenizer\n")
    problems = check_repo(template)
    assert any(p.startswith("preprocessing/1/model.py: not trtglm's") for p in problems), problems
    assert any(p.startswith("ensemble/config.pbtxt: streams tensorrt_llm's output into postprocessing")
               for p in problems)
    assert any("placeholder ${" in p for p in problems)  # fill_template leaves unknown ones in place
    end_id = "ensemble/config.pbtxt: step tensorrt_llm: end_id does not come from preprocessing"
    assert any(p.startswith(end_id) for p in problems) == (version == "v0.7.1")


def test_torch_repository_rendered_from_a_template_copy_checks_clean(tmp_path, fixture_dir):
    repo = patch_repo(make_engine(tmp_path, "torch", fixture_dir), fixture_dir, tmp_path / "repo",
                      template=template_copy(tmp_path))
    assert check_repo(repo) == []
