"""Helpers shared by the model-repository tests (no tests here): engine folders with a trtglm.json
written as `trtglm build-engine` writes it, template copies, and an independent config reader."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import REPO, SHARED
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from trtglm.chatglm.chat import tokenizer_facts
from trtglm.engine.manifest import write_manifest
from trtglm.profile import ServeSection

TEMPLATE = REPO / "triton_model_repo"
UPSTREAM = {version: SHARED / "upstream" / f"tensorrtllm_backend-{version}" / "inflight_batcher_llm"
            for version in ("v0.7.1", "v0.19.0")}
PIPELINE = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
HISTORY_CHAT = "chatglm3-6b"  # the history API of the first ChatGLM3-on-Triton deployments
MODELS = (*PIPELINE, HISTORY_CHAT)
LIMITS = {"max_batch_size": 8, "max_input_len": 384, "max_seq_len": 512, "max_num_tokens": 2048, "max_beam_width": 1}

# A stand-in for trtglm's PyTorch runtime behind the python backend: it answers each prompt
# with the ids script.json gives for it and obeys TensorRT-LLM's rules (generation ends at
# end_id, which is not returned, or after a stop word, which is; streaming sends each new id
# in its own response, STEP_S apart) and trtglm's (generated_ids holds every id so far, is_final marks the
# last response; only requested outputs are sent). Every call is logged to calls.jsonl.
STAND_IN_ENGINE = '''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

STEP_S = 0.01  # streamed tokens come one per step, as an engine's do (a model reading them may fall behind)


def words(word_list):
    out, start = [], 0
    for end in word_list[1]:
        if end < 0:
            break
        out.append([int(i) for i in word_list[0][start:end]])
        start = end
    return out


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.dirname(__file__)
        with open(os.path.join(here, "script.json")) as f:
            self.replies = json.load(f)
        self.log = os.path.join(here, "calls.jsonl")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def generate(self, request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()
        prompt = get("input_ids")[0, :int(get("input_lengths").reshape(-1)[0])].tolist()
        end_id = None if get("end_id") is None else int(get("end_id").reshape(-1)[0])
        stops = words(get("stop_words_list")[0]) if get("stop_words_list") is not None else []
        streaming = get("streaming") is not None and bool(get("streaming").reshape(-1)[0])
        limit = int(get("request_output_len").reshape(-1)[0])
        pad_id = None if get("pad_id") is None else int(get("pad_id").reshape(-1)[0])
        with open(self.log, "a") as f:
            f.write(json.dumps({"prompt": prompt, "end_id": end_id, "pad_id": pad_id, "stops": stops,
                                "streaming": streaming, "max_tokens": limit}) + "\\n")
        out = []
        for token in self.replies.get(json.dumps(prompt), []):
            if len(out) == limit or token == end_id:
                break
            out.append(token)
            if any(out[-len(stop):] == stop for stop in stops):
                break
        return out, streaming

    @staticmethod
    def response(request, ids, so_far, last):
        n = len(ids)
        tensors = {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, n),
            "sequence_length": np.array([[n]], dtype=np.int32),
            "cum_log_probs": np.full((1, 1), -1.5, dtype=np.float32),
            "output_log_probs": np.full((1, 1, n), -0.5, dtype=np.float32),
            "generated_ids": np.array(so_far, dtype=np.int32).reshape(1, 1, len(so_far)),
            "is_final": np.array([[last]], dtype=bool)}
        wanted = set(request.requested_output_names()) or set(tensors)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()
                                                          if name in wanted])

    def execute(self, requests):
        if not self.decoupled:
            return [self.response(r, *(2 * [self.generate(r)[0]]), True) for r in requests]
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            ids, streaming = self.generate(request)
            if streaming:
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    time.sleep(STEP_S)
                    sender.send(self.response(request, [token], ids[:i + 1], last), flags=final if last else 0)
                if not ids:
                    sender.send(self.response(request, [], [], True), flags=final)
            else:
                sender.send(self.response(request, ids, ids, True), flags=final)
        return None
'''


def make_engine(root: Path, kind: str, tokenizer_dir: Path, serve: dict | None = None, limits: dict | None = None,
                mapping: dict | None = None, model: dict | None = None) -> Path:
    """An engine folder (trtglm.json, checkpoint config.json, engine files) for `kind` tensorrt or torch."""
    engine = root / f"engine-{kind}"
    (engine / "checkpoint").mkdir(parents=True, exist_ok=True)
    (engine / "checkpoint" / "config.json").write_text(json.dumps({"vocab_size": engine_vocab(tokenizer_dir)}))
    files = []
    if kind == "tensorrt":
        files = ["config.json", "rank0.engine"]
        (engine / "rank0.engine").write_bytes(b"engine")
        (engine / "config.json").write_text(json.dumps({"build_config": LIMITS}))
    manifest = {
        "format": "trtglm-engine", "format_version": 1, "name": "tiny", "engine": kind, "trtglm_version": "0.1.0",
        "tensorrt_llm_version": None, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1, **(mapping or {})},
        "dtype": "float32", "quantization": {"weight_only": None, "quant_algo": None, "kv_cache_quant_algo": None},
        "limits": {**LIMITS, **(limits or {})}, "checkpoint_dir": "checkpoint", "engine_files": files,
        "tokenizer_dir": str(Path(tokenizer_dir).resolve()), "tokenizer": tokenizer_facts(tokenizer_dir),
        "model": model or {}, "sources": {}, "profile": {"serve": {**asdict(ServeSection()), **(serve or {})}},
    }
    write_manifest(engine, manifest)
    return engine


def engine_vocab(tokenizer_dir: Path) -> int:
    """The checkpoint's vocab_size: the tokenizer's ids padded to a multiple of 64, as ChatGLM3 pads them."""
    return 64 * -(-tokenizer_facts(tokenizer_dir)["vocab_size"] // 64)


def template_copy(root: Path) -> Path:
    """trtglm's template with the stand-in engine as tensorrt_llm/1/model.py (for torch engines)."""
    copy = Path(shutil.copytree(TEMPLATE, root / "template"))
    (copy / "tensorrt_llm" / "1" / "model.py").write_text(STAND_IN_ENGINE)
    return copy


def upstream_copy(root: Path, version: str) -> Path:
    """A copy of NVIDIA's repository layout of `version` (from ../shared/upstream, beside the checkout)."""
    if not UPSTREAM[version].is_dir():
        pytest.skip(f"NVIDIA's {version} repository layout is not at {UPSTREAM[version]} "
                    "(../shared, beside the checkout)")
    return Path(shutil.copytree(UPSTREAM[version], root / f"upstream-{version}"))


def read_configs(repo: Path) -> dict:
    """Every model's config.pbtxt parsed with Triton's ModelConfig protobuf."""
    return {model: text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
            for model in MODELS}


def parameter(config, key: str) -> str:
    return config.parameters[key].string_value


def tree(repo: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file, and the folders (as b"<dir>")."""
    return {p.relative_to(repo).as_posix(): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(repo.rglob("*"))}


def ensemble_step(config, model: str):
    return next(step for step in config.ensemble_scheduling.step if step.model_name == model)
