"""The serving contract of trtglm's own template (triton_model_repo/), as data.

Model names, the parameters trtglm's models read, every tensor each model declares (name, data
type, dims without the batch dimension, optional) and the ensemble's wiring: which tensor of the
ensemble each step's inputs read and its outputs write. An entry marked with a backend exists
only when tensorrt_llm runs on that backend (`python`: trtglm's runtime, which also sends
generated_ids and is_final so the ensemble streams exactly; `tensorrtllm`: NVIDIA's, where
`stream` goes to preprocessing, which refuses it). The BLS model runs the same steps in one
model; its mapping (`bls_*` below) is read off the same wiring. Rendering checks the template
against this table, and the python models take their tensor and parameter names from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ENSEMBLE, PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, BLS = (
    "ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
MODELS = (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, ENSEMBLE, BLS)  # the pipeline (every template has it)
# The history API of the first ChatGLM3-on-Triton deployments (their model name and tensors), which trtglm
# adds to every repository it renders; a python model that calls tensorrt_llm as the BLS model does.
HISTORY_CHAT = "chatglm3-6b"
REPO_MODELS = (*MODELS, HISTORY_CHAT)
PYTHON, TENSORRTLLM = "python", "tensorrtllm"  # tensorrt_llm's backends

# parameters
ENGINE_DIR = "gpt_model_path"  # tensorrt_llm's engine folder (NVIDIA's name, read by both backends)
TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE = "tokenizer_dir", "max_input_len", "max_seq_len", "vocab_size"
LLM_MODEL_NAME, ACCUMULATE_TOKENS = "tensorrt_llm_model_name", "accumulate_tokens"
LLM_DECOUPLED = "decoupled_mode"  # whether tensorrt_llm answers decoupled (the history model is not itself)
CHATGLM_VERSION = "chatglm_version"  # the prompt format: chatglm3, or chatglm2 for a ChatGLM2 engine
KV_CACHE_REUSE = "enable_kv_cache_reuse"  # tensorrt_llm: reuse the KV blocks of a shared prompt prefix (NVIDIA's name)
# model -> parameters trtglm's python model reads (rendering fills each from the placeholder of that name)
PYTHON_MODEL_PARAMETERS: dict[str, tuple[str, ...]] = {
    PREPROCESSING: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION),
    POSTPROCESSING: (TOKENIZER_DIR,),
    BLS: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION, LLM_MODEL_NAME, ACCUMULATE_TOKENS),
    HISTORY_CHAT: (TOKENIZER_DIR, MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB_SIZE, CHATGLM_VERSION, LLM_MODEL_NAME,
                   LLM_DECOUPLED),
}


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # Triton's TYPE_*
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False
    backend: str | None = None  # declared only when tensorrt_llm runs on this backend


@dataclass(frozen=True)
class Model:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def _t(name: str, data_type: str, *dims: int, optional: bool = False, backend: str | None = None) -> Tensor:
    return Tensor(name, f"TYPE_{data_type}", dims, optional, backend)


CLIENT_INPUTS = (  # the ensemble's and the BLS model's
    _t("text_input", "STRING", 1), _t("max_tokens", "INT32", 1),
    _t("bad_words", "STRING", -1, optional=True), _t("stop_words", "STRING", -1, optional=True),
    _t("end_id", "INT32", 1, optional=True), _t("pad_id", "INT32", 1, optional=True),
    _t("top_k", "INT32", 1, optional=True), _t("top_p", "FP32", 1, optional=True),
    _t("temperature", "FP32", 1, optional=True), _t("length_penalty", "FP32", 1, optional=True),
    _t("repetition_penalty", "FP32", 1, optional=True), _t("min_length", "INT32", 1, optional=True),
    _t("presence_penalty", "FP32", 1, optional=True), _t("frequency_penalty", "FP32", 1, optional=True),
    _t("random_seed", "UINT64", 1, optional=True), _t("return_log_probs", "BOOL", 1, optional=True),
    _t("beam_width", "INT32", 1, optional=True), _t("stream", "BOOL", 1, optional=True),
    _t("embedding_bias_words", "STRING", -1, optional=True), _t("embedding_bias_weights", "FP32", -1, optional=True),
)
CLIENT_OUTPUTS = (_t("text_output", "STRING", -1), _t("cum_log_probs", "FP32", -1),
                  _t("output_log_probs", "FP32", -1, -1))

# exclude_input_in_output false: a whole reply starts with the request's text, as NVIDIA's, whose output then
# decodes the prompt's ids too (streamed pieces never do). In a decoupled ensemble Triton refuses a step reading
# both the request and tensorrt_llm's outputs, so trtglm's runtime takes the text (input_text) and the flag, and
# gives postprocessing the prefix (reply_prefix); NVIDIA's C++ backend cannot, so its ensemble lacks the input.
# The BLS model applies them itself: it sends tensorrt_llm none of REPLY_FORM_INPUTS.
EXCLUDE_INPUT = _t("exclude_input_in_output", "BOOL", 1, optional=True)
REPLY_FORM_INPUTS = ("input_text", "exclude_input_in_output")  # tensorrt_llm's

CONTRACT: dict[str, Model] = {
    ENSEMBLE: Model(CLIENT_INPUTS + (replace(EXCLUDE_INPUT, backend=PYTHON),), CLIENT_OUTPUTS),
    BLS: Model(CLIENT_INPUTS + (EXCLUDE_INPUT,), CLIENT_OUTPUTS),
    PREPROCESSING: Model(
        inputs=(_t("QUERY", "STRING", 1), _t("REQUEST_OUTPUT_LEN", "INT32", 1),
                _t("BAD_WORDS_DICT", "STRING", -1, optional=True), _t("STOP_WORDS_DICT", "STRING", -1, optional=True),
                _t("EMBEDDING_BIAS_WORDS", "STRING", -1, optional=True),
                _t("EMBEDDING_BIAS_WEIGHTS", "FP32", -1, optional=True),
                _t("END_ID", "INT32", 1, optional=True), _t("PAD_ID", "INT32", 1, optional=True),
                _t("STREAM", "BOOL", 1, optional=True)),
        outputs=(_t("INPUT_ID", "INT32", -1), _t("REQUEST_INPUT_LEN", "INT32", 1),
                 _t("REQUEST_OUTPUT_LEN", "INT32", 1), _t("BAD_WORDS_IDS", "INT32", 2, -1),
                 _t("STOP_WORDS_IDS", "INT32", 2, -1), _t("EMBEDDING_BIAS", "FP32", -1),
                 _t("OUT_END_ID", "INT32", 1), _t("OUT_PAD_ID", "INT32", 1))),
    TENSORRT_LLM: Model(
        inputs=(_t("input_ids", "INT32", -1), _t("input_lengths", "INT32", 1), _t("request_output_len", "INT32", 1),
                _t("end_id", "INT32", 1, optional=True), _t("pad_id", "INT32", 1, optional=True),
                _t("stop_words_list", "INT32", 2, -1, optional=True),
                _t("bad_words_list", "INT32", 2, -1, optional=True),
                _t("embedding_bias", "FP32", -1, optional=True), _t("beam_width", "INT32", 1, optional=True),
                _t("temperature", "FP32", 1, optional=True), _t("runtime_top_k", "INT32", 1, optional=True),
                _t("runtime_top_p", "FP32", 1, optional=True), _t("len_penalty", "FP32", 1, optional=True),
                _t("repetition_penalty", "FP32", 1, optional=True), _t("min_length", "INT32", 1, optional=True),
                _t("presence_penalty", "FP32", 1, optional=True), _t("frequency_penalty", "FP32", 1, optional=True),
                _t("random_seed", "UINT64", 1, optional=True), _t("return_log_probs", "BOOL", 1, optional=True),
                _t("streaming", "BOOL", 1, optional=True),
                _t("exclude_input_in_output", "BOOL", 1, optional=True, backend=PYTHON),
                _t("input_text", "STRING", 1, optional=True, backend=PYTHON)),
        outputs=(_t("output_ids", "INT32", -1, -1), _t("sequence_length", "INT32", -1),
                 _t("cum_log_probs", "FP32", -1), _t("output_log_probs", "FP32", -1, -1),
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
                _t("max_token", "INT16", -1), _t("history_len", "INT16", -1)),
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


ENSEMBLE_WIRING = (
    _in(PREPROCESSING, "QUERY", "text_input"), _in(PREPROCESSING, "REQUEST_OUTPUT_LEN", "max_tokens"),
    _in(PREPROCESSING, "BAD_WORDS_DICT", "bad_words"), _in(PREPROCESSING, "STOP_WORDS_DICT", "stop_words"),
    _in(PREPROCESSING, "EMBEDDING_BIAS_WORDS", "embedding_bias_words"),
    _in(PREPROCESSING, "EMBEDDING_BIAS_WEIGHTS", "embedding_bias_weights"),
    _in(PREPROCESSING, "END_ID", "end_id"), _in(PREPROCESSING, "PAD_ID", "pad_id"),
    _in(PREPROCESSING, "STREAM", "stream", TENSORRTLLM),  # refused there
    _out(PREPROCESSING, "INPUT_ID", "_INPUT_ID"), _out(PREPROCESSING, "REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
    _out(PREPROCESSING, "REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
    _out(PREPROCESSING, "BAD_WORDS_IDS", "_BAD_WORDS_IDS"), _out(PREPROCESSING, "STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
    _out(PREPROCESSING, "EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
    _out(PREPROCESSING, "OUT_END_ID", "_END_ID"), _out(PREPROCESSING, "OUT_PAD_ID", "_PAD_ID"),
    _in(TENSORRT_LLM, "input_ids", "_INPUT_ID"), _in(TENSORRT_LLM, "input_lengths", "_REQUEST_INPUT_LEN"),
    _in(TENSORRT_LLM, "request_output_len", "_REQUEST_OUTPUT_LEN"),
    _in(TENSORRT_LLM, "end_id", "_END_ID"), _in(TENSORRT_LLM, "pad_id", "_PAD_ID"),
    _in(TENSORRT_LLM, "stop_words_list", "_STOP_WORDS_IDS"), _in(TENSORRT_LLM, "bad_words_list", "_BAD_WORDS_IDS"),
    _in(TENSORRT_LLM, "embedding_bias", "_EMBEDDING_BIAS"),
    _in(TENSORRT_LLM, "runtime_top_k", "top_k"), _in(TENSORRT_LLM, "runtime_top_p", "top_p"),
    _in(TENSORRT_LLM, "temperature", "temperature"), _in(TENSORRT_LLM, "len_penalty", "length_penalty"),
    _in(TENSORRT_LLM, "repetition_penalty", "repetition_penalty"), _in(TENSORRT_LLM, "min_length", "min_length"),
    _in(TENSORRT_LLM, "presence_penalty", "presence_penalty"),
    _in(TENSORRT_LLM, "frequency_penalty", "frequency_penalty"), _in(TENSORRT_LLM, "random_seed", "random_seed"),
    _in(TENSORRT_LLM, "return_log_probs", "return_log_probs"), _in(TENSORRT_LLM, "beam_width", "beam_width"),
    _in(TENSORRT_LLM, "streaming", "stream", PYTHON),
    _in(TENSORRT_LLM, "exclude_input_in_output", "exclude_input_in_output", PYTHON),
    _in(TENSORRT_LLM, "input_text", "text_input", PYTHON),
    _out(TENSORRT_LLM, "output_ids", "_TOKENS_BATCH"), _out(TENSORRT_LLM, "sequence_length", "_SEQUENCE_LENGTH"),
    _out(TENSORRT_LLM, "cum_log_probs", "cum_log_probs"), _out(TENSORRT_LLM, "output_log_probs", "output_log_probs"),
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
