"""Patch a copy of NVIDIA's inflight_batcher_llm (v0.7.1 or v0.19.0) for ChatGLM3.

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
- the client's exclude_input_in_output is no longer passed on (postprocessing decodes
  generated ids only);
- ensemble tensors nothing uses any more are unmapped (Triton refuses unused tensors), as are
  preprocessing outputs trtglm does not produce (encoder-decoder, multimodal, prompt-table
  extras) with whatever read them;
- the parameters trtglm's models read (`MODEL_PARAMETERS`) are added where missing;
- tensorrt_llm's backend follows the engine kind (`python` for trtglm's torch runtime).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trtglm.errors import UsageError
from trtglm.repo.placeholders import CONFIG, MODEL_PARAMETERS, MODELS, PLACEHOLDER, check_filled, fill_text
from trtglm.repo.validate import protobuf

# tensors trtglm's models use: (model, "input" | "output", name, data type, dims, optional)
ADDED_TENSORS = (
    ("preprocessing", "input", "END_ID", "TYPE_INT32", [1], True),
    ("preprocessing", "input", "PAD_ID", "TYPE_INT32", [1], True),
    ("preprocessing", "input", "STREAM", "TYPE_BOOL", [1], True),
    ("preprocessing", "output", "OUT_END_ID", "TYPE_INT32", [1], False),
    ("preprocessing", "output", "OUT_PAD_ID", "TYPE_INT32", [1], False),
)
# tensors trtglm's runtime adds for exact streaming through the ensemble (backend python only)
STREAMING_TENSORS = (
    ("tensorrt_llm", "output", "generated_ids", "TYPE_INT32", [-1, -1], False),
    ("tensorrt_llm", "output", "is_final", "TYPE_BOOL", [1], False),
    ("postprocessing", "input", "GENERATED_IDS", "TYPE_INT32", [-1, -1], True),
    ("postprocessing", "input", "IS_FINAL", "TYPE_BOOL", [1], True),
)
# ensemble wiring: (step's model, "input_map" | "output_map", the model's tensor, the ensemble's tensor)
WIRING = (
    ("preprocessing", "input_map", "END_ID", "end_id"),
    ("preprocessing", "input_map", "PAD_ID", "pad_id"),
    ("preprocessing", "output_map", "OUT_END_ID", "_PREPROCESSOR_END_ID"),
    ("preprocessing", "output_map", "OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
    ("tensorrt_llm", "input_map", "end_id", "_PREPROCESSOR_END_ID"),
    ("tensorrt_llm", "input_map", "pad_id", "_PREPROCESSOR_PAD_ID"),
)
WHOLE_REPLY_WIRING = (("preprocessing", "input_map", "STREAM", "stream"),)  # refused there
STREAMING_WIRING = (
    ("tensorrt_llm", "input_map", "streaming", "stream"),
    ("tensorrt_llm", "output_map", "generated_ids", "_GENERATED_IDS"),
    ("tensorrt_llm", "output_map", "is_final", "_IS_FINAL"),
    ("postprocessing", "input_map", "GENERATED_IDS", "_GENERATED_IDS"),
    ("postprocessing", "input_map", "IS_FINAL", "_IS_FINAL"),
)
WHOLE_REPLY_UNWIRED = (("tensorrt_llm", "streaming"),)  # (step's model, input)
UNWIRED = (("tensorrt_llm", "exclude_input_in_output"),)
# what trtglm's preprocessing produces (backend.preprocessing.assemble)
PREPROCESSING_OUTPUTS = frozenset({"INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID",
                                   "STOP_WORDS_IDS", "BAD_WORDS_IDS", "EMBEDDING_BIAS"})


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


def parse_config(text: str, where: str):
    """A ModelConfig from protobuf text; UsageError with the parser's message."""
    text_format, model_config_pb2 = protobuf()
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise UsageError(f"{where}: not a valid model configuration ({e})") from None


def adapt(configs: dict, values: Mapping[str, str | None]) -> None:
    """The changes listed in the module docstring, in place."""
    pb = protobuf()[1]
    configs["tensorrt_llm"].backend = values["triton_backend"]
    streams = values["triton_backend"] == "python"
    for model, kind, name, data_type, dims, optional in ADDED_TENSORS + (STREAMING_TENSORS if streams else ()):
        tensors = getattr(configs[model], kind)
        if all(t.name != name for t in tensors):
            tensor = tensors.add(name=name, data_type=pb.DataType.Value(data_type), dims=dims)
            if optional:
                tensor.optional = True
    if streams:
        configs["postprocessing"].dynamic_batching.preserve_ordering = True
    steps = {step.model_name: step for step in configs["ensemble"].ensemble_scheduling.step}
    for model, field, key, value in WIRING + (STREAMING_WIRING if streams else WHOLE_REPLY_WIRING):
        getattr(steps[model], field)[key] = value
    for model, key in UNWIRED + (() if streams else WHOLE_REPLY_UNWIRED):
        steps[model].input_map.pop(key, None)
    for key in [k for k in steps["preprocessing"].output_map if k not in PREPROCESSING_OUTPUTS]:
        del steps["preprocessing"].output_map[key]
    _prune(configs["ensemble"])
    for model, names in MODEL_PARAMETERS.items():
        for name in names:
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
