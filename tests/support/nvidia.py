"""NVIDIA's model repository layouts as the tests read them (no tests here): each version's configs parsed
with Triton's ModelConfig protobuf, and the newest layout (TensorRT-LLM v1.2.1's
triton_backend/all_models/inflight_batcher_llm), built from the v0.19.0 copy and the differences between
the two (../shared/reference/trtllm-contract.md §4, checked against the v1.2.1 configs themselves:
min_length and random_seed renamed min_tokens and seed; return_num_input_tokens and
return_num_output_tokens in, num_input_tokens and num_output_tokens out; the prompt table's data type
and preprocessing's hf_model_path and IMAGES)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from support.repos import PIPELINE, UPSTREAM

# what NVIDIA's fill_template examples put in the data-type placeholders
DATA_TYPES = {"logits_datatype": "TYPE_FP32", "encoder_input_features_data_type": "TYPE_FP16",
              "prompt_embedding_table_data_type": "TYPE_FP16"}
RENAMED = {"min_length": "min_tokens", "random_seed": "seed"}  # v0.19.0 -> v1.2.1
COUNT_FLAGS, COUNTS = ("return_num_input_tokens", "return_num_output_tokens"), ("num_input_tokens",
                                                                               "num_output_tokens")
# the models each v1.2.1 change applies to
WITH_COUNTS = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls")


def nvidia_configs(template: Path, data_types: dict[str, str] | None = None) -> dict:
    """model -> ModelConfig of NVIDIA's layout at `template`, the data-type placeholders filled from
    `data_types` (default DATA_TYPES), the others with stand-ins."""
    data_types = {**DATA_TYPES, **(data_types or {})}
    configs = {}
    for model in PIPELINE:  # NVIDIA's layouts have no history model
        text = (template / model / "config.pbtxt").read_text()
        text = re.sub(r"\$\{(\w+)\}", lambda m: data_types.get(m.group(1), "1"), text)
        configs[model] = text_format.Parse(text, model_config_pb2.ModelConfig())
    return configs


def v1_2_1_copy(root: Path) -> Path:
    """NVIDIA's v1.2.1 layout, built from the v0.19.0 copy (see the module docstring)."""
    copy = Path(shutil.copytree(UPSTREAM["v0.19.0"], root / "inflight_batcher_llm-v1.2.1"))
    for model in WITH_COUNTS:
        path = copy / model / "config.pbtxt"
        text = path.read_text()
        for old, new in RENAMED.items():
            text = text.replace(f'"{old}"', f'"{new}"')
        text = _added(text, "input", "".join(_tensor(flag, "TYPE_BOOL") for flag in COUNT_FLAGS))
        text = _added(text, "output", "".join(_tensor(count, "TYPE_INT32", False) for count in COUNTS))
        path.write_text(text)
    ensemble = copy / "ensemble" / "config.pbtxt"
    wires = "".join(f'      input_map {{ key: "{flag}" value: "{flag}" }}\n' for flag in COUNT_FLAGS)
    wires += "".join(f'      output_map {{ key: "{count}" value: "{count}" }}\n' for count in COUNTS)
    ensemble.write_text(re.sub(r'(model_name: "tensorrt_llm"\n\s*model_version: -1\n)', lambda m: m.group(1) + wires,
                               ensemble.read_text()))
    llm = copy / "tensorrt_llm" / "config.pbtxt"
    llm.write_text(re.sub(r'(name: "prompt_embedding_table"\s*data_type: )TYPE_FP16',
                          r"\1${prompt_embedding_table_data_type}", llm.read_text()))
    preprocessing = copy / "preprocessing" / "config.pbtxt"
    text = _added(preprocessing.read_text(), "input", _tensor("IMAGES", "TYPE_STRING", dims="-1"))
    text = re.sub(r'(name: "IMAGE_SIZES"\s*data_type: TYPE_INT64\s*dims: )\[ 2 \]', r"\1[ -1, 2 ]", text)
    preprocessing.write_text(text + 'parameters { key: "hf_model_path" value: { string_value: "${hf_model_path}" } }\n')
    return copy


def _tensor(name: str, data_type: str, optional: bool = True, dims: str = "1") -> str:
    return (f',\n  {{\n    name: "{name}"\n    data_type: {data_type}\n    dims: [ {dims} ]\n'
            f'{"    optional: true" + chr(10) if optional else ""}  }}')


def _added(text: str, kind: str, tensors: str) -> str:
    """`text` with `tensors` (protobuf text, each starting with a comma) at the end of its `kind` list."""
    start = re.search(rf"^{kind} \[", text, re.M).end()
    end = re.compile(r"^\]", re.M).search(text, start).start()
    body = text[start:end].rstrip()
    return text[:start] + body + (tensors if body.strip() else tensors.lstrip(",")) + "\n" + text[end:]
