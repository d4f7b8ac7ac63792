"""The serving contract of trtglm's own template (triton_model_repo/), as data.

Model names, the parameters trtglm's models read, every tensor each model declares (name, data type, dims without
the batch dimension, optional, reshaped, ragged) and the ensemble's wiring: which tensor of the ensemble each step's
inputs read and its outputs write. An entry marked with a backend exists only when tensorrt_llm runs on that backend
(`python`: trtglm's runtime, which also sends generated_ids and is_final so the ensemble streams exactly;
`tensorrtllm`: NVIDIA's, where `stream` goes to preprocessing, which refuses it). The BLS model runs the same steps
in one model; its mapping (`bls_*` below) is read off the same wiring. Rendering writes the template's declarations
from this table (repo/contract_text.py) and checks a repository against it; the python models take their tensor
and parameter names from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from trtglm.chatglm.chat import PROMPT_IDS
from trtglm.chatglm.variants import DEFAULT_VERSION
from trtglm.errors import PromptTooLongError, UsageError
from trtglm.request_config import FIELD, REQUEST_FIELDS

ENSEMBLE, PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, BLS = (
    "ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
MODELS = (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, ENSEMBLE, BLS)  # the pipeline (every template has it)
# The history API of the first ChatGLM3-on-Triton deployments (their model name and tensors), which trtglm
# adds to every repository it renders; a python model that calls tensorrt_llm as the BLS model does.
HISTORY_CHAT = "chatglm3-6b"
REPO_MODELS = (*MODELS, HISTORY_CHAT)
PYTHON, TENSORRTLLM = "python", "tensorrtllm"  # tensorrt_llm's backends

# parameters
STUB = "triton_python_backend_stub"  # the python backend's process of one model instance
ENGINE_DIR = "gpt_model_path"  # tensorrt_llm's engine folder (NVIDIA's name, read by both backends)
TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE = "tokenizer_dir", "max_input_len", "max_seq_len", "vocab_size"
LLM_MODEL_NAME, ACCUMULATE_TOKENS = "tensorrt_llm_model_name", "accumulate_tokens"
LLM_DECOUPLED = "decoupled_mode"  # whether tensorrt_llm answers decoupled (the history model is not itself)
CHATGLM_VERSION = "chatglm_version"  # the prompt format: chatglm3, or chatglm2 for a ChatGLM2 engine
MAX_RETURN_SEQUENCES = "max_return_sequences"  # the profile's serve.max_return_sequences
KV_CACHE_REUSE = "enable_kv_cache_reuse"  # tensorrt_llm: reuse the KV blocks of a shared prompt prefix (NVIDIA's name)
# tensorrt_llm: of the GPU memory left after the weights, what the KV cache takes (NVIDIA's name)
KV_CACHE_FRACTION = "kv_cache_free_gpu_mem_fraction"
# model -> parameters trtglm's python model reads (rendering fills each from the placeholder of that name)
PYTHON_MODEL_PARAMETERS: dict[str, tuple[str, ...]] = {
    PREPROCESSING: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION),
    POSTPROCESSING: (TOKENIZER_DIR,),
    BLS: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION, LLM_MODEL_NAME, ACCUMULATE_TOKENS,
          MAX_RETURN_SEQUENCES),
    TENSORRT_LLM: (MAX_RETURN_SEQUENCES,),  # with backend python; NVIDIA's backend ignores it
    HISTORY_CHAT: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION, LLM_MODEL_NAME,
                   LLM_DECOUPLED),
}


def parameter(params: Mapping[str, str], key: str, model: str) -> str:
    """`model`'s parameter `key`; UsageError when it is missing or was never filled."""
    if key not in params or params[key] == "" or params[key].startswith("${"):
        raise UsageError(f"{model}: parameter {key} is not set (render the repository with trtglm patch-repo)")
    return params[key]


def int_parameter(params: Mapping[str, str], key: str, model: str) -> int:
    value = parameter(params, key, model)
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{model}: parameter {key} must be an integer, not {value!r}") from None


@dataclass(frozen=True)
class Limits:
    """What the engine accepts, as patch-repo wrote it into the parameters of the models that build prompts
    (preprocessing, BLS, the history model), for them and for the OpenAI API."""

    max_input_len: int
    max_seq_len: int
    vocab_size: int  # the engine's vocabulary (embedding bias length)
    chatglm_version: str = DEFAULT_VERSION  # the prompt format its model was trained on (chat.PROMPT_IDS)

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str) -> "Limits":
        """The limits in `model`'s parameters."""
        # a repository rendered before chatglm_version was written is ChatGLM3's
        version = params.get(CHATGLM_VERSION) or DEFAULT_VERSION
        if version not in PROMPT_IDS:
            raise UsageError(f"{model}: parameter {CHATGLM_VERSION} must be one of {', '.join(PROMPT_IDS)}, "
                             f"not {version!r}")
        return cls(**{field: int_parameter(params, field, model) for field in (MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE)},
                   chatglm_version=version)

    def check_prompt_bytes(self, size: int, longest_piece_bytes: int) -> None:
        """PromptTooLongError for a prompt of `size` UTF-8 bytes that cannot fit: a token stands for at most
        `longest_piece_bytes` of normalized text, and normalizing shrinks a character of up to 4 bytes to no less
        than 1, so a larger prompt is refused before tokenizing megabytes."""
        if size > 4 * self.max_input_len * longest_piece_bytes:
            raise PromptTooLongError(f"the prompt ({size:,} bytes) is longer than the engine's max_input_len "
                                     f"({self.max_input_len} tokens) can hold")

    def check_prompt_tokens(self, count: int) -> None:
        if count > self.max_input_len:
            raise PromptTooLongError(f"the prompt is {count} tokens, more than the engine's max_input_len "
                                     f"({self.max_input_len})")


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # Triton's TYPE_*
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False
    backend: str | None = None  # declared only when tensorrt_llm runs on this backend
    lacks: str = ""  # what trtglm's runtime lacks to honour the input: accepted only absent or neutral
    neutral: float = 0.0  # besides zeros, false and empty strings
    scalar: bool = False  # reshaped from [1] to a scalar (reshape { shape: [ ] }), as NVIDIA's tensorrt_llm takes it
    ragged: bool = False  # batched with other requests' of other lengths (allow_ragged_batch)


@dataclass(frozen=True)
class Model:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def _t(name: str, data_type: str, *dims: int, **marks) -> Tensor:
    return Tensor(name, f"TYPE_{data_type}", dims, **marks)


def _opt(name: str, data_type: str, *dims: int, **marks) -> Tensor:
    return _t(name, data_type, *dims, optional=True, **marks)


def _scalar(name: str, data_type: str, **marks) -> Tensor:
    return _opt(name, data_type, 1, scalar=True, **marks)


def _ragged(name: str, data_type: str, *dims: int, **marks) -> Tensor:
    return _opt(name, data_type, *dims, ragged=True, **marks)


def _outputs(spec: str) -> tuple[Tensor, ...]:
    """Outputs from "name:TYPE:dims" words (dims comma-separated)."""
    return tuple(_t(name, data_type, *map(int, dims.split(","))) for name, data_type, dims in
                 (word.split(":") for word in spec.split()))


LORA, PROMPT_TABLE, GUIDED, RETENTION = ("LoRA adapters", "prompt tables (p-tuning)", "guided decoding",
                                         "KV cache retention priorities")
DRAFTS, ENCODER = "speculative decoding (draft tokens)", "encoder or multimodal inputs (ChatGLM3 is decoder-only)"
# NVIDIA's v0.19.0 names and v1.2.1's (min_tokens and seed for min_length and random_seed; return_num_*_tokens)
TRITON_TYPES = {"float32": "FP32", "int32": "INT32", "uint64": "UINT64", "bool": "BOOL"}  # numpy's name -> Triton's


def _with_settings(side: str, others: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The inputs that carry a request's settings (request_config.REQUEST_FIELDS, its one table of them) on the
    client models' side ("ensemble") or tensorrt_llm's ("engine"), under each of their names, then `others` but
    those a setting's input takes over (NVIDIA's inputs a setting honours once the table has a row for it)."""
    settings = tuple(_t(name, TRITON_TYPES[field.dtype], 1, optional=not field.required, scalar=side == "engine")
                     for field in REQUEST_FIELDS for name in field.names(side))
    taken = {t.name for t in settings}
    return settings + tuple(t for t in others if t.name not in taken)


CLIENT_INPUTS = _with_settings("ensemble", (  # the ensemble's and the BLS model's
    _t("text_input", "STRING", 1), _opt("decoder_text_input", "STRING", 1), _opt("num_return_sequences", "INT32", 1),
    _opt("bad_words", "STRING", -1), _opt("stop_words", "STRING", -1),
    _opt("end_id", "INT32", 1), _opt("pad_id", "INT32", 1),
    _opt("return_perf_metrics", "BOOL", 1), _opt("stream", "BOOL", 1),
    _opt("prompt_embedding_table", "FP16", -1, -1), _opt("prompt_table_extra_id", "UINT64", 1),
    _opt("prompt_vocab_size", "INT32", 1),
    _opt("embedding_bias_words", "STRING", -1), _opt("embedding_bias_weights", "FP32", -1),
    _opt("lora_task_id", "UINT64", 1), _ragged("lora_weights", "FP16", -1, -1), _ragged("lora_config", "INT32", -1, 3),
    _ragged("guided_decoding_guide_type", "STRING", 1), _ragged("guided_decoding_guide", "STRING", 1),
    _opt("return_num_input_tokens", "BOOL", 1), _opt("return_num_output_tokens", "BOOL", 1),
))
BLS_ONLY_INPUTS = (  # NVIDIA's BLS model also takes images and draft-model options
    _opt("image_input", "FP16", -1, 3, -1, -1, lacks=ENCODER), _opt("image_bytes_input", "UINT8", -1, -1, -1, -1,
                                                                    lacks=ENCODER),
    _opt("image_url_input", "STRING", 1, lacks=ENCODER), _opt("video_bytes_input", "UINT8", -1, -1, -1, -1,
                                                            lacks=ENCODER),
    _opt("num_draft_tokens", "INT32", 1, lacks=DRAFTS), _opt("use_draft_logits", "BOOL", 1, lacks=DRAFTS),
)
PERF_OUTPUTS = _outputs(  # return_perf_metrics
    "kv_cache_alloc_new_blocks:INT32:1 kv_cache_reused_blocks:INT32:1 kv_cache_alloc_total_blocks:INT32:1 "
    "arrival_time_ns:INT64:1 first_scheduled_time_ns:INT64:1 first_token_time_ns:INT64:1 "
    "last_token_time_ns:INT64:1 acceptance_rate:FP32:1 total_accepted_draft_tokens:INT32:1 "
    "total_draft_tokens:INT32:1")
ENGINE_OUTPUTS = _outputs(  # tensorrt_llm's, which the client gets as they are
    "cum_log_probs:FP32:-1 output_log_probs:FP32:-1,-1 context_logits:FP32:-1,-1 generation_logits:FP32:-1,-1,-1 "
    "batch_index:INT32:1 sequence_index:INT32:1") + PERF_OUTPUTS + _outputs(
    "num_input_tokens:INT32:1 num_output_tokens:INT32:1") + (
    # why a sequence ended, on its last response (trtglm's runtime; NVIDIA's LLM-API model's name): stop | length
    _t("finish_reason", "STRING", 1, backend=PYTHON),)
CLIENT_OUTPUTS = (_t("text_output", "STRING", -1),) + ENGINE_OUTPUTS
# outputs sent only when the request's flag of that name is true (NVIDIA's rule); the others always
FLAGGED_OUTPUTS = {"return_context_logits": ("context_logits",), "return_generation_logits": ("generation_logits",),
                   "return_perf_metrics": tuple(t.name for t in PERF_OUTPUTS),
                   "return_num_input_tokens": ("num_input_tokens",),
                   "return_num_output_tokens": ("num_output_tokens",)}

# exclude_input_in_output false: a whole reply starts with the request's text, as NVIDIA's, whose output then
# decodes the prompt's ids too (streamed pieces never do). In a decoupled ensemble Triton refuses a step reading
# both the request and tensorrt_llm's outputs, so trtglm's runtime takes the text (input_text) and the flag, and
# gives postprocessing the prefix (reply_prefix); NVIDIA's C++ backend cannot, so with it the ensemble routes the
# flag to preprocessing, which refuses false. The BLS model applies them itself: it sends tensorrt_llm none of
# REPLY_FORM_INPUTS.
EXCLUDE_INPUT = _opt("exclude_input_in_output", "BOOL", 1)
REPLY_FORM_INPUTS = ("input_text", "exclude_input_in_output")  # tensorrt_llm's

# tensorrt_llm's (NVIDIA's v0.19.0 and v1.2.1 names); `lacks`: refused unless absent or neutral
ENGINE_INPUTS = _with_settings("engine", (
    _ragged("input_ids", "INT32", -1), _ragged("encoder_input_features", "FP16", -1, -1, lacks=ENCODER),
    _scalar("encoder_output_lengths", "INT32", lacks=ENCODER),
    _t("input_lengths", "INT32", 1, scalar=True),
    _scalar("num_return_sequences", "INT32"),
    _ragged("draft_input_ids", "INT32", -1, lacks=DRAFTS),
    _ragged("decoder_input_ids", "INT32", -1), _scalar("decoder_input_lengths", "INT32"),  # one pad id when unused
    _ragged("draft_logits", "FP32", -1, -1, lacks=DRAFTS), _scalar("draft_acceptance_threshold", "FP32", lacks=DRAFTS),
    _scalar("end_id", "INT32"), _scalar("pad_id", "INT32"),
    _ragged("stop_words_list", "INT32", 2, -1), _ragged("bad_words_list", "INT32", 2, -1),
    _ragged("embedding_bias", "FP32", -1),
    _scalar("runtime_top_p_min", "FP32"), _scalar("runtime_top_p_decay", "FP32", lacks="top-p decay", neutral=1.0),
    _scalar("runtime_top_p_reset_ids", "INT32"),
    _scalar("beam_search_diversity_rate", "FP32"), _scalar("return_perf_metrics", "BOOL"),
    _scalar("exclude_input_in_output", "BOOL"),
    _scalar("stop", "BOOL", lacks="stop requests (cancel the request instead: close its stream)"),
    _scalar("streaming", "BOOL"),
    _ragged("prompt_embedding_table", "FP16", -1, -1, lacks=PROMPT_TABLE),
    _ragged("prompt_table_extra_ids", "UINT64", -1, lacks=PROMPT_TABLE),
    _scalar("prompt_vocab_size", "INT32", lacks=PROMPT_TABLE),
    _ragged("cross_attention_mask", "BOOL", -1, -1, lacks=ENCODER),
    _ragged("mrope_rotary_cos_sin", "FP32", -1, lacks=ENCODER),
    _opt("mrope_position_deltas", "INT64", 1, lacks=ENCODER),
    _scalar("lora_task_id", "UINT64", lacks=LORA), _ragged("lora_weights", "FP16", -1, -1, lacks=LORA),
    _ragged("lora_config", "INT32", -1, 3, lacks=LORA),
    _ragged("context_phase_params", "UINT8", -1, lacks="disaggregated serving"),
    _opt("skip_cross_attn_blocks", "BOOL", 1, lacks=ENCODER),
    *(_ragged(f"retention_token_range_{name}", "INT32", -1, lacks=RETENTION)
      for name in ("starts", "ends", "priorities", "durations_ms")),
    *(_opt(f"retention_decode_{name}", "INT32", 1, lacks=RETENTION) for name in ("priority", "duration_ms")),
    _ragged("guided_decoding_guide_type", "STRING", 1, lacks=GUIDED),
    _ragged("guided_decoding_guide", "STRING", 1, lacks=GUIDED),
    *(_opt(f"lookahead_{name}", "INT32", 1, lacks="lookahead decoding")
      for name in ("window_size", "ngram_size", "verification_set_size")),
    _scalar("return_num_input_tokens", "BOOL"), _scalar("return_num_output_tokens", "BOOL"),
))

# Inputs every request needs, which the client models and preprocessing declare optional all the same: Triton
# 2.51 counts a request's inputs but does not check that each required one is there, and its ensemble scheduler
# ends a request whose step lacks a required input with no response and no error (an empty, complete stream).
# Declared optional, a missing one reaches preprocessing (the BLS model's too), which refuses it by the client's
# name on every path alike.
REQUIRED_BY_PREPROCESSING = ("text_input", "max_tokens")


def _checked_by_preprocessing(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(replace(t, optional=True) if t.name in REQUIRED_BY_PREPROCESSING else t for t in tensors)


CONTRACT: dict[str, Model] = {
    ENSEMBLE: Model(_checked_by_preprocessing(CLIENT_INPUTS) + (EXCLUDE_INPUT,), CLIENT_OUTPUTS),
    BLS: Model(_checked_by_preprocessing(CLIENT_INPUTS) + BLS_ONLY_INPUTS + (EXCLUDE_INPUT,), CLIENT_OUTPUTS),
    PREPROCESSING: Model(
        inputs=(_opt("QUERY", "STRING", 1), _opt("DECODER_QUERY", "STRING", 1, lacks=ENCODER),
                _opt("IMAGE_BYTES", "UINT8", -1, -1, -1, -1, lacks=ENCODER), _opt("IMAGE_URL", "STRING", 1,
                                                                                  lacks=ENCODER),
                _opt("VIDEO_BYTES", "UINT8", -1, -1, -1, -1, lacks=ENCODER),
                _opt("REQUEST_OUTPUT_LEN", "INT32", 1),  # QUERY and this: see REQUIRED_BY_PREPROCESSING
                _opt("BAD_WORDS_DICT", "STRING", -1), _opt("STOP_WORDS_DICT", "STRING", -1),
                _opt("EMBEDDING_BIAS_WORDS", "STRING", -1), _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", -1),
                _opt("END_ID", "INT32", 1), _opt("PAD_ID", "INT32", 1),
                _opt("PROMPT_TABLE_EXTRA_ID", "UINT64", 1, lacks=PROMPT_TABLE),
                _opt("IMAGES", "STRING", -1, lacks=ENCODER),
                _opt("STREAM", "BOOL", 1),
                _opt("EXCLUDE_INPUT_IN_OUTPUT", "BOOL", 1)),
        outputs=_outputs("INPUT_ID:INT32:-1 REQUEST_INPUT_LEN:INT32:1 DECODER_INPUT_ID:INT32:-1 "
                         "REQUEST_DECODER_INPUT_LEN:INT32:1 REQUEST_OUTPUT_LEN:INT32:-1 BAD_WORDS_IDS:INT32:2,-1 "
                         "STOP_WORDS_IDS:INT32:2,-1 EMBEDDING_BIAS:FP32:-1 OUT_END_ID:INT32:1 OUT_PAD_ID:INT32:1 "
                         "OUT_PROMPT_TABLE_EXTRA_IDS:UINT64:-1")),
    TENSORRT_LLM: Model(
        inputs=ENGINE_INPUTS + (_t("input_text", "STRING", 1, optional=True, backend=PYTHON),),
        outputs=_outputs("output_ids:INT32:-1,-1 sequence_length:INT32:-1") + ENGINE_OUTPUTS + (
            _t("context_phase_params", "UINT8", -1),
            _t("generated_ids", "INT32", -1, -1, backend=PYTHON), _t("is_final", "BOOL", 1, backend=PYTHON),
            _t("reply_prefix", "STRING", 1, backend=PYTHON))),
    POSTPROCESSING: Model(
        inputs=(_t("TOKENS_BATCH", "INT32", -1, -1), _t("SEQUENCE_LENGTH", "INT32", -1),
                _t("GENERATED_IDS", "INT32", -1, -1, optional=True), _t("IS_FINAL", "BOOL", 1, optional=True),
                _t("REPLY_PREFIX", "STRING", 1, optional=True)),
        outputs=(_t("OUTPUT", "STRING", -1),)),
    # as those deployments declared it (max_batch_size 0: dims are the whole shape); temperature is text
    HISTORY_CHAT: Model(
        inputs=(_t("prompt", "STRING", -1), _t("history", "STRING", -1), _t("temperature", "STRING", -1),
                _t("max_token", "INT16", -1), _t("history_len", "INT16", -1),
                _opt("top_p", "STRING", -1), _opt("seed", "UINT64", -1)),  # trtglm's: sampling as the other models
        outputs=(_t("response", "STRING", -1), _t("history", "STRING", -1))),
}


@dataclass(frozen=True)
class Wire:
    """One entry of an ensemble step's input_map (reads) or output_map (writes)."""

    step: str
    reads: bool  # True: the step's input `tensor` reads `ensemble_tensor`; False: its output writes it
    tensor: str
    ensemble_tensor: str
    backend: str | None = None


def _in(step: str, tensor: str, ensemble_tensor: str, backend: str | None = None) -> Wire:
    return Wire(step, True, tensor, ensemble_tensor, backend)


def _out(step: str, tensor: str, ensemble_tensor: str, backend: str | None = None) -> Wire:
    return Wire(step, False, tensor, ensemble_tensor, backend)


def _same_name(step: str, *tensors: str) -> tuple[Wire, ...]:
    return tuple(_in(step, tensor, tensor) for tensor in tensors)


# client inputs tensorrt_llm takes under their own names, besides the settings (which `_settings_wires` passes)
PASSED_AS_THEY_ARE = (
    "return_perf_metrics", "num_return_sequences", "prompt_embedding_table", "prompt_vocab_size", "lora_task_id",
    "lora_weights", "lora_config", "guided_decoding_guide_type", "guided_decoding_guide",
    "return_num_input_tokens", "return_num_output_tokens")


def _settings_wires() -> tuple[Wire, ...]:
    """A setting's client input to its tensorrt_llm input, under each name, but where preprocessing takes it."""
    return tuple(_in(TENSORRT_LLM, engine, client) for field in REQUEST_FIELDS if not field.preprocessed
                 for client, engine in zip(field.names("ensemble"), field.names("engine")))
ENSEMBLE_WIRING = (
    _in(PREPROCESSING, "QUERY", "text_input"), _in(PREPROCESSING, "DECODER_QUERY", "decoder_text_input"),
    _in(PREPROCESSING, "REQUEST_OUTPUT_LEN", FIELD["max_tokens"].ensemble),
    _in(PREPROCESSING, "BAD_WORDS_DICT", "bad_words"), _in(PREPROCESSING, "STOP_WORDS_DICT", "stop_words"),
    _in(PREPROCESSING, "EMBEDDING_BIAS_WORDS", "embedding_bias_words"),
    _in(PREPROCESSING, "EMBEDDING_BIAS_WEIGHTS", "embedding_bias_weights"),
    _in(PREPROCESSING, "END_ID", "end_id"), _in(PREPROCESSING, "PAD_ID", "pad_id"),
    _in(PREPROCESSING, "PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id"),
    _in(PREPROCESSING, "STREAM", "stream", TENSORRTLLM),  # refused there
    _in(PREPROCESSING, "EXCLUDE_INPUT_IN_OUTPUT", "exclude_input_in_output", TENSORRTLLM),  # false refused there
    _out(PREPROCESSING, "INPUT_ID", "_INPUT_ID"), _out(PREPROCESSING, "REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
    _out(PREPROCESSING, "DECODER_INPUT_ID", "_DECODER_INPUT_ID"),
    _out(PREPROCESSING, "REQUEST_DECODER_INPUT_LEN", "_REQUEST_DECODER_INPUT_LEN"),
    _out(PREPROCESSING, "REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
    _out(PREPROCESSING, "BAD_WORDS_IDS", "_BAD_WORDS_IDS"), _out(PREPROCESSING, "STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
    _out(PREPROCESSING, "EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
    _out(PREPROCESSING, "OUT_END_ID", "_END_ID"), _out(PREPROCESSING, "OUT_PAD_ID", "_PAD_ID"),
    _out(PREPROCESSING, "OUT_PROMPT_TABLE_EXTRA_IDS", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
    _in(TENSORRT_LLM, "input_ids", "_INPUT_ID"), _in(TENSORRT_LLM, "input_lengths", "_REQUEST_INPUT_LEN"),
    _in(TENSORRT_LLM, "decoder_input_ids", "_DECODER_INPUT_ID"),
    _in(TENSORRT_LLM, "decoder_input_lengths", "_REQUEST_DECODER_INPUT_LEN"),
    _in(TENSORRT_LLM, FIELD["max_tokens"].engine, "_REQUEST_OUTPUT_LEN"),
    _in(TENSORRT_LLM, "end_id", "_END_ID"), _in(TENSORRT_LLM, "pad_id", "_PAD_ID"),
    _in(TENSORRT_LLM, "stop_words_list", "_STOP_WORDS_IDS"), _in(TENSORRT_LLM, "bad_words_list", "_BAD_WORDS_IDS"),
    _in(TENSORRT_LLM, "embedding_bias", "_EMBEDDING_BIAS"),
    _in(TENSORRT_LLM, "prompt_table_extra_ids", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
    *_settings_wires(), *_same_name(TENSORRT_LLM, *PASSED_AS_THEY_ARE),
    _in(TENSORRT_LLM, "streaming", "stream", PYTHON),
    _in(TENSORRT_LLM, "exclude_input_in_output", "exclude_input_in_output"),
    _in(TENSORRT_LLM, "input_text", "text_input", PYTHON),
    _out(TENSORRT_LLM, "output_ids", "_TOKENS_BATCH"), _out(TENSORRT_LLM, "sequence_length", "_SEQUENCE_LENGTH"),
    *(_out(TENSORRT_LLM, tensor.name, tensor.name, tensor.backend) for tensor in ENGINE_OUTPUTS),
    _out(TENSORRT_LLM, "generated_ids", "_GENERATED_IDS", PYTHON), _out(TENSORRT_LLM, "is_final", "_IS_FINAL", PYTHON),
    _out(TENSORRT_LLM, "reply_prefix", "_REPLY_PREFIX", PYTHON),
    _in(POSTPROCESSING, "TOKENS_BATCH", "_TOKENS_BATCH"), _in(POSTPROCESSING, "SEQUENCE_LENGTH", "_SEQUENCE_LENGTH"),
    _in(POSTPROCESSING, "GENERATED_IDS", "_GENERATED_IDS", PYTHON),
    _in(POSTPROCESSING, "IS_FINAL", "_IS_FINAL", PYTHON), _in(POSTPROCESSING, "REPLY_PREFIX", "_REPLY_PREFIX", PYTHON),
    _out(POSTPROCESSING, "OUTPUT", "text_output"),
)


# --- reading the table ---------------------------------------------------------------------------


def for_backend(items, backend: str | None):
    """The tensors or wires that exist when tensorrt_llm runs on `backend`."""
    return tuple(item for item in items if item.backend in (None, backend))


def names(tensors) -> tuple[str, ...]:
    return tuple(tensor.name for tensor in tensors)


def contract_tensor(model: str, kind: str, name: str) -> Tensor:
    """The tensor `name` among `model`'s "input" or "output" tensors."""
    return next(t for t in getattr(CONTRACT[model], f"{kind}s") if t.name == name)


# The BLS model sees each request's whole stream, so whichever backend serves tensorrt_llm it wires
# `stream` as the ensemble does with trtglm's runtime; it pre- and postprocesses in-process.
BLS_VIEW = PYTHON


def step_reads(step: str, backend: str | None = BLS_VIEW) -> dict[str, str]:
    """The step's input -> the ensemble tensor it reads."""
    return {w.tensor: w.ensemble_tensor for w in for_backend(ENSEMBLE_WIRING, backend) if w.step == step and w.reads}


def step_writes(step: str, backend: str | None = BLS_VIEW) -> dict[str, str]:
    """The step's output -> the ensemble tensor it writes."""
    return {w.tensor: w.ensemble_tensor for w in for_backend(ENSEMBLE_WIRING, backend)
            if w.step == step and not w.reads}


def feeds(source: str, target: str, backend: str | None = BLS_VIEW) -> dict[str, str]:
    """`source`'s output -> the input of `target` it feeds (a client input when `source` is ENSEMBLE)."""
    if source == ENSEMBLE:
        written = {name: name for name in names(CONTRACT[ENSEMBLE].inputs)}  # ensemble tensor -> client input
    else:
        written = {tensor: output for output, tensor in step_writes(source, backend).items()}
    return {written[read]: tensor for tensor, read in step_reads(target, backend).items() if read in written}


def client_outputs_from(step: str, backend: str | None = BLS_VIEW) -> dict[str, str]:
    """`step`'s output -> the ensemble output it is (what passes straight through to the client)."""
    outputs = set(names(CONTRACT[ENSEMBLE].outputs))
    return {k: v for k, v in step_writes(step, backend).items() if v in outputs}


def refusal(tensor: Tensor, array, shown: str | None = None) -> str | None:
    """Why `array`, given for an input that trtglm's runtime cannot honour, is refused (None: it is absent or
    neutral, or the input is honoured); `shown` is the input's name in the message (the client's)."""
    shown = shown or tensor.name
    if not tensor.lacks or array is None or array.size == 0:
        return None
    values = array.reshape(-1)
    if values.dtype == object or values.dtype.kind in "SU":
        neutral = all(not v for v in values)
    else:
        neutral = bool(((values == 0) | (values == tensor.neutral)).all())
    return None if neutral else f"{shown}: trtglm's runtime has no {tensor.lacks}; leave {shown} out"


def refuse_unhonoured(model: str, arrays: Mapping, shown: Mapping[str, str] | None = None) -> None:
    """UsageError naming the first of `model`'s inputs given a value trtglm's runtime cannot honour (`refusal`);
    `shown`: {input: the client's name for it} where the client names it otherwise."""
    for tensor in CONTRACT[model].inputs:
        why = refusal(tensor, arrays.get(tensor.name), (shown or {}).get(tensor.name))
        if why:
            raise UsageError(why)


def flag_set(array) -> bool:
    """Whether a request's BOOL input is given and true (a batch's first value)."""
    return array is not None and array.size > 0 and bool(array.reshape(-1)[0])
