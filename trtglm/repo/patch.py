"""Patch a copy of NVIDIA's inflight_batcher_llm (v0.7.1, v0.19.0 or v1.2.1) for ChatGLM3.

Each config.pbtxt is filled (`placeholders.fill_text`), parsed with Triton's own model_config
protobuf, adapted, and written back as protobuf text under its original header comment.
The adaptation puts trtglm's python models in place of NVIDIA's preprocessing,
postprocessing and BLS (whose tokenization gets ChatGLM3's end/pad ids, stop tokens and chat
template wrong) and makes the layout carry what they need:

- parameters whose placeholder is UNSET are removed (the reader's own default applies);
- preprocessing takes END_ID/PAD_ID and gives OUT_END_ID/OUT_PAD_ID, which the ensemble
  routes to tensorrt_llm (v0.7.1 passed the client's end_id straight to the engine, so
  without one generation never stopped at `</s>`);
- with NVIDIA's tensorrtllm backend the ensemble does not stream: `stream` goes to
  preprocessing, which refuses it (from new ids alone an ensemble's postprocessing cannot
  continue a request's text across streamed responses; the BLS model streams); with trtglm's
  runtime (backend python) `stream` stays wired to tensorrt_llm, which also declares
  generated_ids and is_final, and the ensemble routes them to postprocessing (optional inputs
  GENERATED_IDS and IS_FINAL, in order: preserve_ordering), which then streams exactly;
- exclude_input_in_output: with trtglm's runtime tensorrt_llm also takes text_input
  (input_text) and gives postprocessing the prefix of a whole reply (reply_prefix ->
  REPLY_PREFIX: the request's text when it is false); NVIDIA's backend would then return the
  prompt's ids, which postprocessing cannot tell from the reply's, so there the ensemble also
  routes it to preprocessing (EXCLUDE_INPUT_IN_OUTPUT), which refuses false (tensorrt_llm_bls
  takes it);
- every input NVIDIA's configs declare stays declared and wired; the inputs trtglm's models
  cannot honour (LoRA, prompt tables, guided decoding, draft tokens, multimodal) are refused by
  them when set (contract.Tensor.lacks); preprocessing outputs trtglm does not produce
  (multimodal) are unmapped, with whatever read them, and ensemble tensors nothing uses any
  more with them (Triton refuses unused tensors);
- the parameters trtglm's models read (`contract.PYTHON_MODEL_PARAMETERS`) are added where missing;
- text_input and max_tokens (QUERY, REQUEST_OUTPUT_LEN) are optional, refused by preprocessing when missing
  (contract.REQUIRED_BY_PREPROCESSING);
- tensorrt_llm's backend follows the engine kind (`python` for trtglm's torch runtime).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trtglm.backend.contract import (BLS, CONTRACT, ENSEMBLE, ENSEMBLE_WIRING, POSTPROCESSING, PREPROCESSING, PYTHON,
                                     PYTHON_MODEL_PARAMETERS, REQUIRED_BY_PREPROCESSING, TENSORRT_LLM, TENSORRTLLM,
                                     contract_tensor, feeds, names)
from trtglm.errors import UsageError
from trtglm.model_repository import CONFIG, parse_config, protobuf
from trtglm.repo.placeholders import MODELS, PLACEHOLDER, check_filled, fill_text

# tensors of trtglm's contract that NVIDIA's layouts lack: (model, "input" | "output", name)
ADDED_TENSORS = ((PREPROCESSING, "input", "END_ID"), (PREPROCESSING, "input", "PAD_ID"),
                 (PREPROCESSING, "input", "STREAM"), (PREPROCESSING, "input", "EXCLUDE_INPUT_IN_OUTPUT"),
                 (PREPROCESSING, "output", "OUT_END_ID"),
                 (PREPROCESSING, "output", "OUT_PAD_ID"))
# those trtglm's runtime adds for exact streaming through the ensemble and the prompt before a whole reply
# (backend python only)
STREAMING_TENSORS = ((TENSORRT_LLM, "output", "generated_ids"), (TENSORRT_LLM, "output", "is_final"),
                     (POSTPROCESSING, "input", "GENERATED_IDS"), (POSTPROCESSING, "input", "IS_FINAL"),
                     (TENSORRT_LLM, "input", "exclude_input_in_output"), (TENSORRT_LLM, "input", "input_text"),
                     (TENSORRT_LLM, "output", "reply_prefix"), (POSTPROCESSING, "input", "REPLY_PREFIX"))
# ensemble wiring: (step's model, "input_map" | "output_map", the model's tensor, the ensemble's tensor)
WIRING = (  # end and pad ids through preprocessing, under NVIDIA's names for the ensemble's tensors
    (PREPROCESSING, "input_map", "END_ID", "end_id"),
    (PREPROCESSING, "input_map", "PAD_ID", "pad_id"),
    (PREPROCESSING, "output_map", "OUT_END_ID", "_PREPROCESSOR_END_ID"),
    (PREPROCESSING, "output_map", "OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
    (TENSORRT_LLM, "input_map", "end_id", "_PREPROCESSOR_END_ID"),
    (TENSORRT_LLM, "input_map", "pad_id", "_PREPROCESSOR_PAD_ID"),
)


def _backend_wiring(backend: str) -> tuple[tuple[str, str, str, str], ...]:
    """The contract's wires that exist only with `backend` (`stream` and the streaming tensors)."""
    return tuple((w.step, "input_map" if w.reads else "output_map", w.tensor, w.ensemble_tensor)
                 for w in ENSEMBLE_WIRING if w.backend == backend)


WHOLE_REPLY_WIRING = _backend_wiring(TENSORRTLLM)  # `stream` to preprocessing, which refuses it
STREAMING_WIRING = _backend_wiring(PYTHON)
# (step's model, input)
WHOLE_REPLY_UNWIRED = ((TENSORRT_LLM, "streaming"),)
# declared optional, refused by preprocessing when missing (contract.REQUIRED_BY_PREPROCESSING says why)
CHECKED_BY_PREPROCESSING = {ENSEMBLE: REQUIRED_BY_PREPROCESSING, BLS: REQUIRED_BY_PREPROCESSING,
                            PREPROCESSING: tuple(feeds(ENSEMBLE, PREPROCESSING)[n] for n in REQUIRED_BY_PREPROCESSING)}
PREPROCESSING_OUTPUTS = frozenset(names(CONTRACT[PREPROCESSING].outputs))  # what trtglm's preprocessing produces


def patch_upstream(template: Path, version: str, values: Mapping[str, str | None]) -> dict[str, bytes]:
    """{model/config.pbtxt: bytes} of the patched configs (the caller adds trtglm's model files)."""
    text_format = protobuf()[0]
    configs, headers = {}, {}
    for model in MODELS:
        path = template / model / CONFIG
        text = path.read_text(encoding="utf-8")
        headers[model] = _header(text)
        configs[model] = parse_config(fill_text(text, values, str(path)), str(path))
        _drop_unset_parameters(configs[model], values)
    adapt(configs, values)
    files = {}
    for model in MODELS:
        text = headers[model] + text_format.MessageToString(configs[model], as_utf8=True)
        check_filled(text, f"{template / model / CONFIG} ({version}, patched)")
        files[f"{model}/{CONFIG}"] = text.encode("utf-8")
    return files


def adapt(configs: dict, values: Mapping[str, str | None]) -> None:
    """The changes listed in the module docstring, in place."""
    pb = protobuf()[1]
    configs[TENSORRT_LLM].backend = values["triton_backend"]
    streams = values["triton_backend"] == PYTHON
    for model, kind, name in ADDED_TENSORS + (STREAMING_TENSORS if streams else ()):
        tensors = getattr(configs[model], kind)
        if all(t.name != name for t in tensors):
            spec = contract_tensor(model, kind, name)
            tensor = tensors.add(name=name, data_type=pb.DataType.Value(spec.data_type), dims=spec.dims)
            if spec.optional:
                tensor.optional = True
    for model, names_ in CHECKED_BY_PREPROCESSING.items():
        for tensor in configs[model].input if model in configs else ():
            if tensor.name in names_:
                tensor.optional = True
    if streams:
        configs[POSTPROCESSING].dynamic_batching.preserve_ordering = True
    steps = {step.model_name: step for step in configs[ENSEMBLE].ensemble_scheduling.step}
    for model, field, key, value in WIRING + (STREAMING_WIRING if streams else WHOLE_REPLY_WIRING):
        getattr(steps[model], field)[key] = value
    for model, key in () if streams else WHOLE_REPLY_UNWIRED:
        steps[model].input_map.pop(key, None)
    for key in [k for k in steps[PREPROCESSING].output_map if k not in PREPROCESSING_OUTPUTS]:
        del steps[PREPROCESSING].output_map[key]
    _prune(configs[ENSEMBLE])
    for model, parameters in PYTHON_MODEL_PARAMETERS.items():
        for name in parameters if model in configs else ():
            if name not in configs[model].parameters:
                configs[model].parameters[name].string_value = values[name]


def _prune(ensemble_config) -> None:
    """Until nothing changes: unmap inputs read from tensors nobody provides, outputs nobody reads,
    and drop ensemble inputs no step reads."""
    steps = ensemble_config.ensemble_scheduling.step
    outputs = {tensor.name for tensor in ensemble_config.output}
    changed = True
    while changed:
        provided = {t.name for t in ensemble_config.input} | {v for s in steps for v in s.output_map.values()}
        read = {v for s in steps for v in s.input_map.values()}
        dead_inputs = [(s, k) for s in steps for k, v in s.input_map.items() if v not in provided]
        dead_outputs = [(s, k) for s in steps for k, v in s.output_map.items() if v not in read | outputs]
        unread = [i for i, t in enumerate(ensemble_config.input) if t.name not in read]
        for step, key in dead_inputs:
            del step.input_map[key]
        for step, key in dead_outputs:
            del step.output_map[key]
        for index in reversed(unread):
            del ensemble_config.input[index]
        changed = bool(dead_inputs or dead_outputs or unread)


def _drop_unset_parameters(config, values: Mapping[str, str | None]) -> None:
    for key in list(config.parameters):
        match = PLACEHOLDER.fullmatch(config.parameters[key].string_value)
        if match and match.group(1) in values and values[match.group(1)] is None:
            del config.parameters[key]


def _header(text: str) -> str:
    """The comment lines a file starts with (NVIDIA's copyright and license notice)."""
    lines = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line.lstrip().startswith("#"):
            break
        lines.append(line)
    return "".join(lines).rstrip("\n") + "\n\n" if lines else ""
