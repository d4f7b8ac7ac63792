"""What fills each placeholder: the engine's trtglm.json, its profile's serve section, `--set`.

`placeholder_values` gives a value for every placeholder any known template carries. A value
of `UNSET` leaves an upstream parameter to its reader's own default: patching an upstream copy
removes that parameter entry instead of writing a guess (an absent parameter is what NVIDIA's
backend treats as "not specified"). Everything else is explicit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from trtglm.backend.contract import LLM_MODEL_NAME, TENSORRT_LLM
from trtglm.engine.manifest import MANIFEST, Manifest
from trtglm.errors import ModelFileError, UsageError
from trtglm.repo.placeholders import known_placeholders

UNSET = None

BACKENDS = {"tensorrt": "tensorrtllm", "torch": "python"}  # engine kind -> tensorrt_llm's backend
DATATYPES = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}

# Upstream parameters for features trtglm does not configure (LoRA, speculative decoding,
# encoder-decoder and multimodal models, statistics, device placement, KV-cache tuning).
BACKEND_DEFAULTS = frozenset("""
    multimodal_model_path max_num_images encoder_engine_dir max_tokens_in_paged_kv_cache
    max_attention_window_size sink_token_length max_num_sequences cross_kv_cache_fraction
    kv_cache_host_memory_bytes kv_cache_onboard_blocks cancellation_check_period_ms stats_check_period_ms
    iter_stats_max_iterations request_stats_max_iterations normalize_log_probs enable_chunked_context
    gpu_device_ids participant_ids num_nodes lora_cache_optimal_adapter_size lora_cache_max_adapter_size
    lora_cache_gpu_memory_fraction lora_cache_host_memory_bytes lora_prefetch_dir decoding_mode
    lookahead_window_size lookahead_ngram_size lookahead_verification_set_size medusa_choices eagle_choices
    gpu_weights_percent enable_context_fmha_fp32_acc multi_block_mode cuda_graph_mode cuda_graph_cache_size
    speculative_decoding_fast_logits guided_decoding_backend xgrammar_tokenizer_info_path
    tensorrt_llm_draft_model_name multimodal_encoders_name hf_model_path
""".split())

SERVE_KEYS = {  # placeholder -> key of the profile's serve section
    "decoupled_mode": "decoupled",
    "batching_strategy": "batching_strategy",
    "batch_scheduler_policy": "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction": "kv_cache_free_gpu_mem_fraction",
    "max_queue_delay_microseconds": "max_queue_delay_microseconds",
    "max_queue_size": "max_queue_size",
    "max_return_sequences": "max_return_sequences",
    "preprocessing_instance_count": "preprocessing_instances",
    "postprocessing_instance_count": "postprocessing_instances",
    "bls_instance_count": "bls_instances",
}
LIMIT_KEYS = {  # placeholder -> the engine's limit (manifest.Limits)
    "triton_max_batch_size": "max_batch_size",
    "max_beam_width": "max_beam_width",
    "max_input_len": "max_input_len",
    "max_seq_len": "max_seq_len",
}
FIXED = {
    "exclude_input_in_output": True,  # postprocessing decodes generated ids only
    LLM_MODEL_NAME: TENSORRT_LLM,
    "accumulate_tokens": False,  # streamed text_output pieces are deltas
    "enable_kv_cache_reuse": False,
    "enable_trt_overlap": False,
    "logits_datatype": "TYPE_FP32",  # the checkpoint's logits_dtype
    "prompt_embedding_table_data_type": "TYPE_FP16",  # what the ensemble passes on (trtglm refuses prompt tables)
    # read only by NVIDIA's model.py files, which trtglm replaces; filled with what is true
    "tokenizer_type": "chatglm3",
    "add_special_tokens": True,
    "skip_special_tokens": True,
}


def placeholder_values(manifest: Manifest, tokenizer_dir: str, version: str,
                       sets: Mapping[str, object]) -> dict[str, str | None]:
    """Placeholder -> text (or UNSET) for a template of `version`; `sets` overrides (unknown key: UsageError)."""
    values: dict[str, object] = {name: UNSET for name in BACKEND_DEFAULTS}
    values.update(FIXED)
    values.update({name: getattr(manifest.limits, key) for name, key in LIMIT_KEYS.items()})
    values.update({name: _serve(manifest, key) for name, key in SERVE_KEYS.items()})
    if not values["bls_instance_count"]:  # 0: one BLS instance per sequence the engine runs at once
        values["bls_instance_count"] = manifest.limits.max_batch_size
    values.update(engine_dir=str(manifest.engine_dir), tokenizer_dir=str(tokenizer_dir),
                  triton_backend=BACKENDS[manifest.engine], vocab_size=_vocab_size(manifest),
                  encoder_input_features_data_type=_datatype(manifest),
                  chatglm_version=manifest.model.get("chatglm_version", "chatglm3"))
    known = known_placeholders(version)
    for name, value in sets.items():
        if name not in known:
            raise UsageError(f"--set {name}: not a placeholder of the {version} template "
                             f"(known: {', '.join(sorted(known))})")
        values[name] = value
    return {name: as_text(value) for name, value in values.items()}


def as_text(value: object) -> str | None:
    """How a value is written into config.pbtxt (booleans lower-case, as protobuf text spells them)."""
    if value is UNSET:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_sets(pairs: Iterable[str] | str | None) -> dict[str, str]:
    """`--set` value(s) -> {placeholder: text}: `["a=1", "b=2"]` or one `"a=1"`."""
    if pairs is None:
        return {}
    sets = {}
    for pair in [pairs] if isinstance(pairs, str) else [str(p) for p in pairs]:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {pair}: expected PLACEHOLDER=VALUE, e.g. triton_max_batch_size=8")
        sets[key.strip()] = value
    return sets


def _vocab_size(manifest: Manifest) -> int:
    """The engine's vocabulary (padded, e.g. 65024 for ChatGLM3-6B), from its checkpoint's config.json."""
    path = manifest.checkpoint_dir / "config.json"
    try:
        vocab_size = json.loads(path.read_text(encoding="utf-8"))["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{path}: cannot read vocab_size ({type(e).__name__}: {e})") from None
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ModelFileError(f"{path}: vocab_size must be a positive integer, not {vocab_size!r}")
    return vocab_size


def _datatype(manifest: Manifest) -> str:
    if manifest.dtype not in DATATYPES:
        raise ModelFileError(f"{manifest.engine_dir}/{MANIFEST}: dtype {manifest.dtype!r} is not one of "
                             f"{', '.join(DATATYPES)}")
    return DATATYPES[manifest.dtype]


def _serve(manifest: Manifest, key: str) -> object:
    serve = manifest.serve
    if key not in serve:
        raise ModelFileError(f"{manifest.engine_dir}/{MANIFEST}: profile.serve lacks {key}")
    return serve[key]
