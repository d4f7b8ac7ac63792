"""The `${name}` placeholders: which ones each template trtglm knows carries (one table), and filling them.

A template is recognised by the exact set of placeholders its five config.pbtxt files carry
outside comments: trtglm's own template (triton_model_repo/) or a copy of NVIDIA's
`inflight_batcher_llm` at v0.7.1, v0.19.0 or v1.2.1 (TensorRT-LLM's own triton_backend copy).
`contract.PYTHON_MODEL_PARAMETERS` lists the parameters that trtglm's python models read; patching
an upstream copy adds the ones it lacks, each filled from the placeholder of the same name, so
`--set` accepts them for every version.
"""

from __future__ import annotations

import re

from collections.abc import Mapping

from trtglm.backend.contract import MODELS, PYTHON_MODEL_PARAMETERS
from trtglm.errors import UsageError

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
BARE_VALUE = re.compile(r"[A-Za-z0-9_.+-]+")  # what may stand outside quotes (numbers, enums, booleans)
TRTGLM = "trtglm"


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# version -> model -> placeholders its config.pbtxt carries (outside comments)
PLACEHOLDERS: dict[str, dict[str, frozenset[str]]] = {
    TRTGLM: {
        "preprocessing": _names("triton_max_batch_size max_queue_delay_microseconds max_queue_size "
                                "tokenizer_dir max_input_len max_seq_len vocab_size chatglm_version "
                                "preprocessing_instance_count"),
        "tensorrt_llm": _names("triton_backend triton_max_batch_size decoupled_mode max_queue_delay_microseconds "
                               "max_queue_size max_beam_width batching_strategy engine_dir batch_scheduler_policy "
                               "kv_cache_free_gpu_mem_fraction exclude_input_in_output enable_kv_cache_reuse "
                               "max_return_sequences"),
        "postprocessing": _names("triton_max_batch_size tokenizer_dir postprocessing_instance_count"),
        "ensemble": _names("triton_max_batch_size"),
        "tensorrt_llm_bls": _names("triton_max_batch_size decoupled_mode bls_instance_count accumulate_tokens "
                                   "tensorrt_llm_model_name tokenizer_dir max_input_len max_seq_len vocab_size "
                                   "chatglm_version max_return_sequences"),
    },
    "v0.7.1": {
        "preprocessing": _names("triton_max_batch_size tokenizer_dir tokenizer_type preprocessing_instance_count"),
        "tensorrt_llm": _names("triton_max_batch_size decoupled_mode max_queue_delay_microseconds max_beam_width "
                               "batching_strategy engine_dir max_tokens_in_paged_kv_cache max_attention_window_size "
                               "batch_scheduler_policy kv_cache_free_gpu_mem_fraction max_num_sequences "
                               "enable_trt_overlap exclude_input_in_output enable_kv_cache_reuse"),
        "postprocessing": _names("triton_max_batch_size tokenizer_dir tokenizer_type postprocessing_instance_count"),
        "ensemble": _names("triton_max_batch_size"),
        "tensorrt_llm_bls": _names("triton_max_batch_size decoupled_mode bls_instance_count accumulate_tokens"),
    },
    "v0.19.0": {
        "preprocessing": _names("triton_max_batch_size tokenizer_dir add_special_tokens multimodal_model_path "
                                "engine_dir max_num_images max_queue_delay_microseconds max_queue_size "
                                "preprocessing_instance_count"),
        "tensorrt_llm": _names(
            "triton_backend triton_max_batch_size decoupled_mode max_queue_delay_microseconds max_queue_size "
            "logits_datatype encoder_input_features_data_type max_beam_width batching_strategy engine_dir "
            "encoder_engine_dir max_tokens_in_paged_kv_cache max_attention_window_size sink_token_length "
            "batch_scheduler_policy kv_cache_free_gpu_mem_fraction cross_kv_cache_fraction "
            "kv_cache_host_memory_bytes kv_cache_onboard_blocks exclude_input_in_output "
            "cancellation_check_period_ms stats_check_period_ms iter_stats_max_iterations "
            "request_stats_max_iterations enable_kv_cache_reuse normalize_log_probs enable_chunked_context "
            "gpu_device_ids participant_ids num_nodes lora_cache_optimal_adapter_size lora_cache_max_adapter_size "
            "lora_cache_gpu_memory_fraction lora_cache_host_memory_bytes lora_prefetch_dir decoding_mode "
            "lookahead_window_size lookahead_ngram_size lookahead_verification_set_size medusa_choices "
            "eagle_choices gpu_weights_percent enable_context_fmha_fp32_acc multi_block_mode cuda_graph_mode "
            "cuda_graph_cache_size speculative_decoding_fast_logits tokenizer_dir guided_decoding_backend "
            "xgrammar_tokenizer_info_path"),
        "postprocessing": _names("triton_max_batch_size tokenizer_dir skip_special_tokens "
                                 "postprocessing_instance_count"),
        "ensemble": _names("triton_max_batch_size logits_datatype"),
        "tensorrt_llm_bls": _names("triton_max_batch_size decoupled_mode bls_instance_count accumulate_tokens "
                                   "logits_datatype tensorrt_llm_model_name tensorrt_llm_draft_model_name "
                                   "multimodal_encoders_name"),
    },
}


# The newest templates (TensorRT-LLM v1.2.1 triton_backend/all_models/inflight_batcher_llm) add two placeholders
PLACEHOLDERS["v1.2.1"] = {**PLACEHOLDERS["v0.19.0"],
                          "preprocessing": PLACEHOLDERS["v0.19.0"]["preprocessing"] | {"hf_model_path"},
                          "tensorrt_llm": PLACEHOLDERS["v0.19.0"]["tensorrt_llm"] | {
                              "prompt_embedding_table_data_type"}}


def known_placeholders(version: str) -> frozenset[str]:
    """Every placeholder `--set` may name for a template of `version`."""
    added = {name for names in PYTHON_MODEL_PARAMETERS.values() for name in names}
    return frozenset().union(*PLACEHOLDERS[version].values(), added)


def detect_version(found: dict[str, frozenset[str]], where: str) -> str:
    """The version whose placeholder table equals `found` (model -> placeholders); UsageError if none."""
    missing = [m for m in MODELS if m not in found]
    if missing:
        raise UsageError(f"{where}: not a model repository template: no {missing[0]}/config.pbtxt")
    for version, table in PLACEHOLDERS.items():
        if all(found[m] == table[m] for m in MODELS):
            return version
    closest = min(PLACEHOLDERS, key=lambda v: sum(len(found[m] ^ PLACEHOLDERS[v][m]) for m in MODELS))
    model = next(m for m in MODELS if found[m] != PLACEHOLDERS[closest][m])
    extra = sorted(found[model] - PLACEHOLDERS[closest][model])
    lacking = sorted(PLACEHOLDERS[closest][model] - found[model])
    detail = f"has ${{{extra[0]}}}" if extra else f"lacks ${{{lacking[0]}}}"
    raise UsageError(f"{where}: placeholders match no known template ({', '.join(PLACEHOLDERS)}); "
                     f"closest is {closest}, but {model}/config.pbtxt {detail}")


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a protobuf text line: the comment starts at a # outside quotes."""
    quoted = escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = quoted
        elif char == '"':
            quoted = not quoted
        elif char == "#" and not quoted:
            return line[:i], line[i:]
    return line, ""


def fill_text(text: str, values: Mapping[str, str | None], where: str) -> str:
    """`text` with each known, set placeholder replaced (outside comments); others are left as they are.

    A value inside quotes is escaped for protobuf text; one outside quotes must be a plain word.
    """
    lines = []
    for line in text.splitlines(keepends=True):
        code, comment = split_comment(line)
        lines.append(_fill_code(code, values, where) + comment)
    return "".join(lines)


def _fill_code(code: str, values: Mapping[str, str | None], where: str) -> str:
    return PLACEHOLDER.sub(lambda match: _replacement(match, code, values, where), code)


def check_filled(text: str, where: str) -> None:
    """UsageError naming the first placeholder left in `text` outside comments."""
    for number, line in enumerate(text.splitlines(), 1):
        match = PLACEHOLDER.search(split_comment(line)[0])
        if match:
            raise UsageError(f"{where}:{number}: placeholder ${{{match.group(1)}}} is left unfilled "
                             f"(give it with --set {match.group(1)}=VALUE)")


def _replacement(match: re.Match, line: str, values: Mapping[str, str | None], where: str) -> str:
    name = match.group(1)
    value = values.get(name)
    if value is None:
        return match.group(0)
    quoted = line[match.start() - 1:match.start()] == '"' and line[match.end():match.end() + 1] == '"'
    if quoted:
        if "\n" in value:
            raise UsageError(f"{where}: ${{{name}}}: a value must be one line")
        return value.replace("\\", "\\\\").replace('"', '\\"')
    if not BARE_VALUE.fullmatch(value):
        raise UsageError(f"{where}: ${{{name}}} stands outside quotes, so its value must be a number or a "
                         f"word, not {value!r}")
    return value
