"""YAML profiles: the shipped ones load, and every kind of mistake is one line naming file and key."""

import copy
import json
import logging
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from trtglm.errors import ModelFileError, UsageError
from trtglm.profile import load_profile, parse_overrides

CONFIGS = REPO / "configs"
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))

# A complete valid profile (a 6B fp16 tp1 recipe) that each test changes one thing in.
BASE = {
    "model": {"variant": "chatglm3-6b", "dir": None},
    "convert": {"dtype": "float16", "tp_size": 1, "pp_size": 1, "weight_only": None},
    "build": {"engine": "tensorrt", "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512,
              "max_num_tokens": 2048, "max_beam_width": 1, "kv_cache_type": "paged", "gemm_plugin": "auto",
              "gpt_attention_plugin": "auto", "context_fmha": True, "remove_input_padding": True,
              "use_paged_context_fmha": False, "tokens_per_block": 64},
    "serve": {"batching_strategy": "inflight_fused_batching", "decoupled": True,
              "preprocessing_instances": 1, "postprocessing_instances": 1, "bls_instances": 1,
              "kv_cache_free_gpu_mem_fraction": 0.9, "batch_scheduler_policy": "guaranteed_no_evict",
              "max_queue_delay_microseconds": 0, "max_queue_size": 0, "http_port": 8000, "grpc_port": 8001,
              "metrics_port": 8002},
}


def write_profile(folder: Path, changes: dict | None = None, deletions=(), name="p.yaml") -> Path:
    """BASE with dotted-key `changes` and `deletions` applied, written as YAML."""
    data = copy.deepcopy(BASE)
    for key, value in (changes or {}).items():
        section, _, field = key.partition(".")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    for key in deletions:
        section, _, field = key.partition(".")
        if field:
            del data[section][field]
        else:
            del data[section]
    path = folder / "configs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def error_of(path, overrides=None, kind=UsageError) -> str:
    with pytest.raises(kind) as info:
        load_profile(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: "), message
    return message


def test_every_required_profile_is_shipped():
    wanted = {"chatglm3-6b-fp16-tp1.yaml", "chatglm3-6b-bf16-tp1.yaml", "chatglm3-6b-int8-tp1.yaml",
              "chatglm3-6b-int4-tp1.yaml", "chatglm3-6b-fp16-tp2.yaml", "chatglm3-6b-fp16-tp4.yaml",
              "chatglm3-6b-32k-fp16-tp1.yaml", "chatglm3-6b-128k-fp16-tp1.yaml", "tiny.yaml"}
    assert wanted <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_are_complete_and_valid(name):
    raw = yaml.safe_load((CONFIGS / name).read_text(encoding="utf-8"))
    profile = load_profile(CONFIGS / name)
    # complete recipes: every key written out, none left to defaults
    assert {s: set(v) for s, v in raw.items()} == {s: set(v) for s, v in profile.to_dict().items()}
    assert "world_size" not in raw["serve"]  # derived: tp × pp
    assert profile.name == name.removesuffix(".yaml")


def test_shipped_profiles_say_what_their_names_say():
    facts = {  # name -> (variant, dtype, weight_only, tp, engine)
        "chatglm3-6b-fp16-tp1": ("chatglm3-6b", "float16", None, 1, "auto"),
        "chatglm3-6b-bf16-tp1": ("chatglm3-6b", "bfloat16", None, 1, "auto"),
        "chatglm3-6b-int8-tp1": ("chatglm3-6b", "float16", "int8", 1, "auto"),
        "chatglm3-6b-int4-tp1": ("chatglm3-6b", "float16", "int4", 1, "auto"),
        "chatglm3-6b-fp16-tp2": ("chatglm3-6b", "float16", None, 2, "auto"),
        "chatglm3-6b-fp16-tp4": ("chatglm3-6b", "float16", None, 4, "auto"),
        "chatglm3-6b-32k-fp16-tp1": ("chatglm3-6b-32k", "float16", None, 1, "auto"),
        "chatglm3-6b-128k-fp16-tp1": ("chatglm3-6b-128k", "float16", None, 1, "auto"),
    }
    for name, expected in facts.items():
        p = load_profile(CONFIGS / f"{name}.yaml")
        assert (p.model.variant, p.convert.dtype, p.convert.weight_only, p.convert.tp_size, p.build.engine) == expected
    tiny = load_profile(CONFIGS / "tiny.yaml")
    assert tiny.build.engine == "torch" and tiny.convert.tp_size == 1
    assert tiny.convert.dtype in ("float32", "float16")
    assert (tiny.build.max_batch_size, tiny.build.max_input_len, tiny.build.max_seq_len) == (8, 256, 512)


def test_relative_model_dir_is_relative_to_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_profile(CONFIGS / "tiny.yaml").model.dir == str(REPO / "tests" / "fixtures" / "tiny-chatglm3")
    # a profile elsewhere: relative to the parent of its folder
    path = write_profile(tmp_path / "proj", {"model.dir": "models/m"})
    assert load_profile(path).model.dir == str((tmp_path / "proj" / "models" / "m").resolve())


def test_fp8_profile_and_its_calibration_prompts(tmp_path):
    fp8 = load_profile(CONFIGS / "chatglm3-6b-fp8-tp1.yaml")
    assert (fp8.quant_algo, fp8.kv_cache_quant_algo, fp8.convert.calibration_prompts) == ("FP8", "FP8", None)
    assert (load_profile(CONFIGS / "chatglm3-6b-int8-tp1.yaml").quant_algo,
            load_profile(CONFIGS / "chatglm3-6b-fp16-tp1.yaml").kv_cache_quant_algo) == ("W8A16", None)
    path = write_profile(tmp_path / "proj", {"convert.fp8": True, "convert.calibration_prompts": "data/p.txt"})
    assert load_profile(path).convert.calibration_prompts == str((tmp_path / "proj" / "data" / "p.txt").resolve())
    given = load_profile(path, {"convert.calibration_prompts": "/x/p.jsonl"})  # an override is used as given
    assert given.convert.calibration_prompts == "/x/p.jsonl"


def test_defaults_fill_optional_keys(tmp_path):
    path = write_profile(tmp_path, deletions=["build.max_num_tokens", "build.tokens_per_block", "serve.http_port",
                                              "convert.pp_size", "convert.weight_only", "model.dir"])
    p = load_profile(path)
    assert p.build.max_num_tokens == min(8192, 8 * 512)  # TensorRT-LLM's default, capped by the batch
    assert (p.build.tokens_per_block, p.serve.http_port, p.convert.pp_size, p.convert.weight_only) == (64, 8000, 1, None)
    assert p.model.dir is None


def test_a_profile_that_still_gives_the_world_size_loads_with_a_note(tmp_path, caplog):
    path = write_profile(tmp_path, {"convert.tp_size": 2, "serve.world_size": 2})
    with caplog.at_level(logging.INFO, logger="trtglm.profile"):
        p = load_profile(path)
    assert p.world_size == 2 and "world_size" not in p.to_dict()["serve"]
    assert "serve.world_size is convert.tp_size × convert.pp_size, derived" in caplog.text


def test_overrides_are_applied_before_validation(tmp_path):
    path = write_profile(tmp_path)
    p = load_profile(path, {"build.max_batch_size": 16, "convert.tp_size": 2, "serve.world_size": 2})
    assert (p.build.max_batch_size, p.convert.tp_size, p.world_size) == (16, 2, 2)
    assert "serve.world_size (1)" in error_of(path, {"convert.tp_size": 2, "serve.world_size": 1})
    assert "unknown key" in error_of(path, {"build.max_batchsize": 16})
    assert "SECTION.KEY" in error_of(path, {"max_batch_size": 16})


def test_model_dir_override_is_used_as_given(tmp_path):
    path = write_profile(tmp_path, {"model.dir": "relative/in/profile"})
    assert load_profile(path, {"model.dir": str(tmp_path / "elsewhere")}).model.dir == str(tmp_path / "elsewhere")


def test_parse_overrides_reads_values_as_yaml():
    assert parse_overrides(["build.max_batch_size=16", "convert.weight_only=null", "model.dir=/a/b=c",
                            "build.context_fmha=false", "serve.kv_cache_free_gpu_mem_fraction=0.5"]) == {
        "build.max_batch_size": 16, "convert.weight_only": None, "model.dir": "/a/b=c",
        "build.context_fmha": False, "serve.kv_cache_free_gpu_mem_fraction": 0.5}
    assert parse_overrides(None) == {}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_overrides(["build.max_batch_size"])


# (changes, deletions, expected message after "<file>: ")
INVALID = {
    "unknown top-level key": ({"extras": {"a": 1}}, [], "unknown key extras"),
    "unknown nested key": ({"build.max_batchsize": 8}, [], "unknown key build.max_batchsize"),
    "string for int": ({"build.max_batch_size": "eight"}, [], "build.max_batch_size must be an integer, not 'eight'"),
    "bool for int": ({"convert.tp_size": True}, [], "convert.tp_size must be an integer, not True"),
    "int for bool": ({"build.context_fmha": 1}, [], "build.context_fmha must be true or false, not 1"),
    "number for string": ({"convert.dtype": 16}, [], "convert.dtype must be a string, not 16"),
    "missing key": ({}, ["build.max_seq_len"], "missing required key build.max_seq_len"),
    "missing section": ({}, ["serve"], "missing section serve"),
    "section not a mapping": ({"build": [1, 2]}, [], "build must be a mapping"),
    "input not below seq": ({"build.max_input_len": 8192, "build.max_seq_len": 4096, "build.max_num_tokens": 8192},
                            [], "build.max_input_len (8192) must be < build.max_seq_len (4096)"),
    "world size": ({"convert.tp_size": 2, "serve.world_size": 1}, [],
                   "serve.world_size (1) must equal convert.tp_size × convert.pp_size"),
    "tp not supported": ({"convert.tp_size": 3}, [], "convert.tp_size must be one of 1, 2, 4, 8"),
    "pp": ({"convert.pp_size": 2}, [], "convert.pp_size must be one of 1, not 2"),
    "weight-only fp32": ({"convert.weight_only": "int8", "convert.dtype": "float32"}, [],
                         "convert.weight_only (int8) needs convert.dtype float16 or bfloat16"),
    "weight-only kind": ({"convert.weight_only": "int2"}, [], "convert.weight_only must be one of null, int8, int4"),
    "fp8 and weight-only": ({"convert.fp8": True, "convert.weight_only": "int4"}, [],
                            "convert.fp8 and convert.weight_only (int4) exclude one another"),
    "fp8 fp32": ({"convert.fp8": True, "convert.dtype": "float32"}, [], "convert.fp8 needs convert.dtype float16"),
    "fp8 kv alone": ({"convert.fp8_kv_cache": True}, [], "convert.fp8_kv_cache needs convert.fp8 true"),
    "prompts alone": ({"convert.calibration_prompts": "p.txt"}, [], "convert.calibration_prompts needs convert.fp8"),
    "dtype": ({"convert.dtype": "fp16"}, [], "convert.dtype must be one of float16, bfloat16, float32"),
    "variant": ({"model.variant": "chatglm4"}, [], "model.variant must be one of"),
    "32k limit": ({"model.variant": "chatglm3-6b-32k", "build.max_batch_size": 3, "build.max_seq_len": 32768,
                   "build.max_input_len": 1024}, [],
                  "build.max_batch_size × build.max_beam_width × build.max_seq_len (3 × 1 × 32768 = 98304) "
                  "must be ≤ 78398 for chatglm3-6b-32k"),
    "seq above variant": ({"build.max_seq_len": 16384, "build.max_input_len": 1024}, [],
                          "build.max_seq_len (16384) exceeds the model's seq_length (8192, from the chatglm3-6b variant)"),
    "negative": ({"build.max_batch_size": 0}, [], "build.max_batch_size must be ≥ 1, not 0"),
    "fraction": ({"serve.kv_cache_free_gpu_mem_fraction": 1.5}, [],
                 "serve.kv_cache_free_gpu_mem_fraction must be ≤ 1.0, not 1.5"),
    "ports": ({"serve.grpc_port": 8000}, [], "serve.grpc_port (8000) is the same as serve.http_port"),
    "num tokens below input": ({"build.max_num_tokens": 128}, [],
                               "build.max_num_tokens (128) must be ≥ build.max_input_len (256)"),
    "num tokens above batch": ({"build.max_num_tokens": 10000}, [],
                               "build.max_num_tokens (10000) must be ≤ build.max_batch_size × build.max_seq_len (4096)"),
    "tokens per block": ({"build.tokens_per_block": 48}, [], "build.tokens_per_block must be a power of two"),
    "inflight needs paged": ({"build.kv_cache_type": "continuous"}, [],
                             "serve.batching_strategy inflight_fused_batching needs a paged KV cache"),
    "paged context fmha": ({"build.use_paged_context_fmha": True, "build.context_fmha": False}, [],
                           "build.use_paged_context_fmha needs build.context_fmha true"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_profile_is_one_line_naming_file_and_key(tmp_path, case):
    changes, deletions, expected = INVALID[case]
    path = write_profile(tmp_path, changes, deletions)
    assert error_of(path).startswith(f"{path}: {expected}")


def test_input_len_message_is_exact(tmp_path):
    path = write_profile(tmp_path, {"build.max_input_len": 8192, "build.max_seq_len": 4096,
                                    "build.max_num_tokens": 8192})
    assert error_of(path) == f"{path}: build.max_input_len (8192) must be < build.max_seq_len (4096)"


def test_32k_limit_boundary(tmp_path):
    def profile(variant, seq, name):
        return write_profile(tmp_path, {"model.variant": variant, "build.max_batch_size": 3, "build.max_seq_len": seq,
                                        "build.max_input_len": 1024}, name=name)

    assert load_profile(profile("chatglm3-6b-32k", 26132, "a.yaml")).build.max_seq_len == 26132  # 78396
    assert "(3 × 1 × 26133 = 78399) must be ≤ 78398" in error_of(profile("chatglm3-6b-32k", 26133, "b.yaml"))
    assert "must be ≤ 78398 for chatglm2-6b-32k" in error_of(profile("chatglm2-6b-32k", 26133, "c.yaml"))
    # -base has the same length without rope scaling, and no such limit
    assert load_profile(profile("chatglm3-6b-base", 32768, "d.yaml")).build.max_batch_size == 3


def test_seq_len_checked_against_the_hf_config(tmp_path):
    from trtglm.convert.synth import preset_config

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**preset_config("tiny"), "seq_length": 300}), encoding="utf-8")
    path = write_profile(tmp_path, {"model.dir": str(hf), "model.variant": "chatglm3-tiny"})
    assert error_of(path) == (f"{path}: build.max_seq_len (512) exceeds the model's seq_length (300, from "
                              f"{hf / 'config.json'})")
    (hf / "config.json").write_text("{not json", encoding="utf-8")
    assert "model.dir" in error_of(path, kind=ModelFileError)


def test_128k_profile_takes_thudms_whole_context(tmp_path):
    """THUDM's chatglm3-6b-128k config.json: seq_length 131072, rope_ratio 500 (base 5,000,000)."""
    from trtglm.chatglm.config import CHATGLM3_6B_CONFIG, ChatGLMConfig

    hf = tmp_path / "chatglm3-6b-128k"
    hf.mkdir()
    thudm = {**CHATGLM3_6B_CONFIG, "_name_or_path": "THUDM/chatglm3-6b-128k", "seq_length": 131072, "rope_ratio": 500}
    (hf / "config.json").write_text(json.dumps(thudm), encoding="utf-8")
    config = ChatGLMConfig.from_model_dir(hf)
    assert (config.variant, config.seq_length, config.rotary_base) == ("chatglm3-6b-128k", 131072, 5_000_000.0)
    path = CONFIGS / "chatglm3-6b-128k-fp16-tp1.yaml"
    profile = load_profile(path, {"model.dir": str(hf)})
    assert (profile.build.max_seq_len, profile.build.max_input_len) == (131072, 131072 - 4096)
    assert profile.model.variant == config.variant
    assert "build.max_seq_len (131073) exceeds the model's seq_length (131072" in error_of(
        path, {"model.dir": str(hf), "build.max_seq_len": 131073})


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  variant: [chatglm3-6b\nconvert: {}\n", encoding="utf-8")
    assert "not valid YAML at line" in error_of(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n", encoding="utf-8")
    assert "expected a mapping" in error_of(listing)
    assert "profile not found" in error_of(tmp_path / "missing.yaml")


def test_profile_is_frozen(tmp_path):
    p = load_profile(write_profile(tmp_path))
    with pytest.raises(AttributeError):
        p.build.max_batch_size = 4
