"""`trtglm patch-repo --check`: the problems of a Triton model repository, one line each.

Checked: every config.pbtxt parses as Triton's ModelConfig and has no placeholder left; each
model has a version folder, python models a model.py there, and trtglm's ChatGLM3 models
stand in for NVIDIA's preprocessing, postprocessing and BLS; ensembles as Triton checks them
(steps name existing models, mapped tensors exist with matching types and dims, required
inputs are fed, no tensor is unused, every output is produced, no step mixes tensors of
different decoupled origins, batch sizes fit) and tensorrt_llm's end_id comes from
preprocessing; against the engine (trtglm.json, or TensorRT-LLM's config.json for an engine
built elsewhere): batch sizes, input and sequence lengths, beam width, the backend for the
engine kind, tp × pp = world size; streaming: tensorrt_llm, BLS and the profile agree on
decoupled mode (the chatglm3-6b history model is never decoupled and says how tensorrt_llm
is), and the ensemble streams only when its postprocessing reads tensorrt_llm's
generated_ids and is_final (trtglm's runtime sends them; from new ids alone postprocessing
cannot decode streamed ChatGLM3 text intact), which NVIDIA's tensorrtllm backend does not
produce.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from trtglm.backend.contract import (ENGINE_DIR, HISTORY_CHAT, LLM_DECOUPLED, MODELS, PYTHON_MODEL_PARAMETERS,
                                     TENSORRT_LLM)
from trtglm.engine.manifest import MANIFEST, Limits, Manifest, read_manifest
from trtglm.errors import ModelFileError
from trtglm.model_repository import (CONFIG, config_path, described_mapping, engine_description, engine_folder,
                                     parse_config, protobuf)
from trtglm.repo.placeholders import PLACEHOLDER, split_comment
from trtglm.repo.values import BACKENDS

# trtglm's python models, which stand in for NVIDIA's (tensorrt_llm is its runtime's or NVIDIA's C++ backend)
TRTGLM_MODELS = tuple(model for model in PYTHON_MODEL_PARAMETERS if model != TENSORRT_LLM)
TRTGLM_IMPORT = re.compile(r"^\s*(from|import)\s+trtglm\b", re.M)
LENGTH_PARAMETERS = ("max_input_len", "max_seq_len")  # parameters that must not exceed the engine's
# the engine's limits a repository is checked against (max_num_tokens is the engine's alone)
CHECKED_LIMITS = tuple(f.name for f in fields(Limits) if f.name != "max_num_tokens")
WHOLE_STREAM = {"generated_ids": "GENERATED_IDS", "is_final": "IS_FINAL"}  # trtglm runtime's -> postprocessing


@dataclass(frozen=True)
class Engine:
    """What the repository is checked against."""

    where: str
    kind: str  # tensorrt | torch
    limits: Mapping[str, int]  # CHECKED_LIMITS
    tp_size: int
    pp_size: int
    world_sizes: Mapping[str, int]  # where a world size is stated -> its value
    decoupled: bool | None  # the profile's serve.decoupled, when known


def check_repo(repo: str | Path, manifest: Manifest | None = None) -> list[str]:
    """The repository's problems (empty when none); `manifest` saves reading the engine's trtglm.json."""
    repo = Path(repo)
    if not repo.is_dir():
        return [f"{repo}: not a folder"]
    configs, problems, broken = _load(repo)
    problems += _layout(repo, configs)
    problems += _ensembles(configs, broken)
    engine = _engine(configs, manifest, problems)
    if engine is not None:
        problems += _against_engine(configs, engine)
    problems += _streaming(configs, engine)
    return problems


# --- files ---------------------------------------------------------------------------------------


def _load(repo: Path) -> tuple[dict, list[str], set[str]]:
    """(model -> ModelConfig, problems, models whose config.pbtxt exists but cannot be used)"""
    configs, problems, broken = {}, [], set()
    names = sorted({p.parent.name for p in repo.glob(f"*/{CONFIG}")} | set(MODELS))
    for name in names:
        path = config_path(repo, name)
        where = f"{name}/{CONFIG}"
        if not path.is_file():
            problems.append(f"{where}: missing")
            continue
        text = path.read_text(encoding="utf-8")
        leftover = [m.group(1) for line in text.splitlines() for m in PLACEHOLDER.finditer(split_comment(line)[0])]
        if leftover:
            problems.append(f"{where}: placeholder ${{{leftover[0]}}} is left unfilled")
            broken.add(name)
            continue
        try:
            configs[name] = parse_config(text, where)
        except ModelFileError as e:
            problems.append(str(e))
            broken.add(name)
    return configs, problems, broken


def _layout(repo: Path, configs: dict) -> list[str]:
    problems = []
    for name, config in configs.items():
        if config.name and config.name != name:
            problems.append(f"{name}/config.pbtxt: name is {config.name!r}, but the folder is {name}")
        versions = [d for d in (repo / name).iterdir() if d.is_dir() and d.name.isdigit()]
        if not versions:
            problems.append(f"{name}: no version folder (e.g. {name}/1/)")
        if config.backend == "python":
            problems += [f"{name}/{d.name}/model.py: missing (python backend)" for d in sorted(versions)
                         if not (d / "model.py").is_file()]
    for name in TRTGLM_MODELS:
        model_py = repo / name / "1" / "model.py"
        if model_py.is_file() and not TRTGLM_IMPORT.search(model_py.read_text(encoding="utf-8")):
            problems.append(f"{name}/1/model.py: not trtglm's (NVIDIA's gets ChatGLM3's end/pad ids, stop tokens "
                            "and chat template wrong); render the repository with trtglm patch-repo")
    return problems


# --- ensembles (the rules Triton applies when it loads one) -------------------------------------


def _ensembles(configs: dict, broken: set[str]) -> list[str]:
    problems = []
    for name, config in configs.items():
        if config.platform == "ensemble":
            problems += [f"{name}/config.pbtxt: {p}" for p in _ensemble(config, configs, broken)]
    return problems


def _ensemble(config, configs: dict, broken: set[str]) -> list[str]:
    """Members' tensors are checked where their configs load; the wiring itself always."""
    every = list(config.ensemble_scheduling.step)
    steps = [s for s in every if s.model_name in configs]
    problems = [f"step {s.model_name}: no such model in the repository"
                for s in every if s.model_name not in configs and s.model_name not in broken]
    if len(config.instance_group):
        problems.append("an ensemble takes no instance_group")
    sources = {t.name: (t.data_type, _dims(t, config.max_batch_size > 0, reshaped=True)) for t in config.input}
    for step in steps:
        member = configs[step.model_name]
        declared = {t.name: t for t in member.output}
        for key, value in step.output_map.items():
            if key not in declared:
                problems.append(f"step {step.model_name}: output_map names {key}, which it does not declare")
            else:
                sources[value] = (declared[key].data_type, _dims(declared[key], member.max_batch_size > 0))
        if config.max_batch_size > member.max_batch_size > 0:
            problems.append(f"max_batch_size {config.max_batch_size} exceeds {step.model_name}'s "
                            f"{member.max_batch_size}")
    unchecked = {v for s in every if s.model_name not in configs for v in s.output_map.values()}
    for step in steps:
        problems += _step_inputs(step, configs[step.model_name], sources, unchecked)
    problems += _unused(config, every)
    if len(steps) == len(every):
        problems += _decoupled_origins(config, steps, configs)
    problems += _end_id_source(every)
    if any(s.model_name == "tensorrt_llm" and "streaming" in s.input_map for s in every) \
            and not _postprocessing_sees_whole_stream(every):
        problems.append("streams tensorrt_llm's output into postprocessing, which sees only each response's new "
                        "ids and so loses spaces and splits characters; route tensorrt_llm's generated_ids and "
                        "is_final to it (trtglm's runtime) or stream with tensorrt_llm_bls")
    return problems


def _postprocessing_sees_whole_stream(steps) -> bool:
    """postprocessing reads tensorrt_llm's generated_ids and is_final (every id so far, the last response)."""
    llm = next((s for s in steps if s.model_name == "tensorrt_llm"), None)
    post = next((s for s in steps if s.model_name == "postprocessing"), None)
    if llm is None or post is None:
        return False
    return all(name in llm.output_map and post.input_map.get(key) == llm.output_map[name]
               for name, key in WHOLE_STREAM.items())


def _step_inputs(step, member, sources: dict, unchecked: set[str]) -> list[str]:
    """`unchecked`: tensors of steps whose model config could not be read."""
    problems = []
    declared = {t.name: t for t in member.input}
    for key, value in step.input_map.items():
        if value in unchecked and key in declared:
            continue
        if key not in declared:
            problems.append(f"step {step.model_name}: input_map names {key}, which it does not declare")
        elif value not in sources:
            problems.append(f"step {step.model_name}: input {key} reads {value}, which no ensemble input or step "
                            "provides")
        else:
            data_type, dims = sources[value]
            want = (declared[key].data_type, _dims(declared[key], member.max_batch_size > 0))
            if data_type != want[0]:
                problems.append(f"step {step.model_name}: input {key} is {_type(want[0])} but {value} is "
                                f"{_type(data_type)}")
            elif not (_same_dims(dims[0], want[1][0]) or _same_dims(dims[1], want[1][1])):
                problems.append(f"step {step.model_name}: input {key} has dims {list(want[1][0])} but {value} has "
                                f"{list(dims[0])}")
    problems += [f"step {step.model_name}: required input {t.name} is not mapped"
                 for t in member.input if not t.optional and t.name not in step.input_map]
    return problems


def _end_id_source(steps) -> list[str]:
    """tensorrt_llm's end_id comes from preprocessing, which fills in ChatGLM3's </s> when the client sends none."""
    llm = next((s for s in steps if s.model_name == "tensorrt_llm"), None)
    pre = next((s for s in steps if s.model_name == "preprocessing"), None)
    if llm is None or pre is None or llm.input_map.get("end_id") in set(pre.output_map.values()):
        return []
    return ["step tensorrt_llm: end_id does not come from preprocessing, so a request without end_id never stops "
            "at </s>"]


def _unused(config, steps) -> list[str]:
    read = {v for s in steps for v in s.input_map.values()}
    produced = {v for s in steps for v in s.output_map.values()}
    outputs = {t.name for t in config.output}
    problems = [f"input {t.name} is read by no step" for t in config.input if t.name not in read]
    problems += [f"tensor {name} is written but never read" for name in sorted(produced - read - outputs)]
    problems += [f"output {name} is produced by no step" for name in sorted(outputs - produced)]
    return problems


def _decoupled_origins(config, steps, configs: dict) -> list[str]:
    """Triton's rule: a step, and the ensemble's outputs together, read tensors of one decoupled origin only
    (each decoupled step starts a new origin; other steps pass on their inputs' origin)."""
    origin = {t.name: "the request" for t in config.input}
    problems, pending = [], list(steps)
    while pending:
        ready = [s for s in pending if all(v in origin for v in s.input_map.values())]
        if not ready:
            break
        for step in ready:
            pending.remove(step)
            seen = {origin[v] for v in step.input_map.values()}
            if len(seen) > 1:
                problems.append(f"step {step.model_name} reads tensors from different decoupled origins "
                                f"({', '.join(sorted(seen))}); Triton refuses that")
            decoupled = configs[step.model_name].model_transaction_policy.decoupled
            out = f"decoupled {step.model_name}" if decoupled else (min(seen) if seen else "the request")
            origin.update({v: out for v in step.output_map.values()})
    seen = {origin[t.name] for t in config.output if t.name in origin}
    if len(seen) > 1:
        problems.append(f"the outputs come from different decoupled origins ({', '.join(sorted(seen))}); "
                        "Triton refuses that")
    return problems


def _dims(tensor, batching: bool, reshaped: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims, dims with the batch dimension) of a tensor (an ensemble input's reshape counts, as in Triton)."""
    dims = tuple(tensor.reshape.shape) if reshaped and tensor.HasField("reshape") else tuple(tensor.dims)
    return dims, ((-1,) + dims if batching else dims)


def _same_dims(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _type(data_type: int) -> str:
    return protobuf()[1].DataType.Name(data_type)


# --- the engine ----------------------------------------------------------------------------------


def _engine(configs: dict, manifest: Manifest | None, problems: list[str]) -> Engine | None:
    """The engine the repository serves: from `manifest`, else from tensorrt_llm's engine folder."""
    if manifest is None:
        config = configs.get(TENSORRT_LLM)
        if config is None:
            return None
        where = f"{TENSORRT_LLM}/{CONFIG}"
        try:
            folder = engine_folder(config, where)
        except ModelFileError as e:
            problems.append(str(e))
            return None
        try:
            return _engine_from_dir(folder)
        except ModelFileError as e:
            problems.append(f"{where}: {ENGINE_DIR}: {e}")
            return None
    return _engine_from_manifest(manifest)


def _engine_from_dir(engine_dir: Path) -> Engine:
    name, description = engine_description(engine_dir)
    if name == MANIFEST:
        return _engine_from_manifest(read_manifest(engine_dir))
    try:
        build, mapping = description["build_config"], described_mapping(name, description)
        limits = {k: int(build[k]) for k in CHECKED_LIMITS}
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        world = {f"{name} mapping.world_size": int(mapping.get("world_size", tp * pp))}
    except (AttributeError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{engine_dir / name}: not a TensorRT-LLM engine config ({type(e).__name__}: {e})") \
            from None
    return Engine(str(engine_dir), "tensorrt", limits, tp, pp, world, decoupled=None)


def _engine_from_manifest(manifest: Manifest) -> Engine:
    world = {f"{MANIFEST} mapping.world_size": manifest.mapping.world_size}
    serve = manifest.profile.get("serve", {})
    if "world_size" in serve:  # an engine built when profiles gave it
        world["profile serve.world_size"] = serve["world_size"]
    limits = {k: v for k, v in asdict(manifest.limits).items() if k in CHECKED_LIMITS}
    return Engine(str(manifest.engine_dir), manifest.engine, limits, manifest.mapping.tp_size, manifest.mapping.pp_size,
                  world, serve.get("decoupled"))


def _against_engine(configs: dict, engine: Engine) -> list[str]:
    problems = []
    limit = engine.limits["max_batch_size"]
    problems += [f"{name}/config.pbtxt: max_batch_size {c.max_batch_size} exceeds the engine's {limit}"
                 for name, c in configs.items() if c.max_batch_size > limit]
    problems += [f"engine {engine.where}: {where} is {size}, but tp × pp = {engine.tp_size} × {engine.pp_size}"
                 for where, size in engine.world_sizes.items() if size != engine.tp_size * engine.pp_size]
    problems += _parameters_against_engine(configs, engine)
    llm = configs.get("tensorrt_llm")
    if llm is not None and llm.backend != BACKENDS[engine.kind]:
        problems.append(f"tensorrt_llm/config.pbtxt: backend is {llm.backend!r}, but a {engine.kind} engine needs "
                        f"{BACKENDS[engine.kind]!r}")
    if llm is not None and llm.backend != "python":
        problems += [f"tensorrt_llm/config.pbtxt: declares {t.name}, which only trtglm's runtime (backend python) "
                     "produces" for t in llm.output if t.name in WHOLE_STREAM]
    return problems


def _parameters_against_engine(configs: dict, engine: Engine) -> list[str]:
    checks = [("tensorrt_llm", "max_beam_width")] + [(m, p) for m in TRTGLM_MODELS for p in LENGTH_PARAMETERS]
    problems = []
    for model, key in checks:
        if model not in configs or key not in configs[model].parameters:
            continue
        text = configs[model].parameters[key].string_value
        if not text.strip().isdigit():
            problems.append(f"{model}/config.pbtxt: parameter {key} must be a whole number, not {text!r}")
        elif int(text) > engine.limits[key]:
            problems.append(f"{model}/config.pbtxt: parameter {key} {text} exceeds the engine's {engine.limits[key]}")
    for model in TRTGLM_MODELS:
        config = configs.get(model)
        if config is not None and "tokenizer_dir" in config.parameters:
            folder = Path(config.parameters["tokenizer_dir"].string_value)
            if not (folder / "tokenizer.model").is_file():
                problems.append(f"{model}/config.pbtxt: tokenizer_dir {folder} has no tokenizer.model")
    llm = configs.get("tensorrt_llm")
    if llm is not None and "exclude_input_in_output" in llm.parameters:
        if llm.parameters["exclude_input_in_output"].string_value.strip().lower() not in ("true", "1"):
            problems.append("tensorrt_llm/config.pbtxt: exclude_input_in_output must be true (postprocessing "
                            "decodes generated ids only)")
    return problems


# --- streaming ----------------------------------------------------------------------------------


def _streaming(configs: dict, engine: Engine | None) -> list[str]:
    """tensorrt_llm, the BLS model and the profile agree on decoupled (streaming) mode."""
    llm = configs.get("tensorrt_llm")
    if llm is None:
        return []
    decoupled = llm.model_transaction_policy.decoupled
    problems = []
    if engine is not None and engine.decoupled is not None and engine.decoupled != decoupled:
        problems.append(f"tensorrt_llm/config.pbtxt: decoupled is {_word(decoupled)}, but the profile's "
                        f"serve.decoupled is {_word(engine.decoupled)}")
    bls = configs.get("tensorrt_llm_bls")
    if bls is not None and bls.model_transaction_policy.decoupled != decoupled:
        problems.append(f"tensorrt_llm_bls/config.pbtxt: decoupled is {_word(bls.model_transaction_policy.decoupled)}"
                        f", but tensorrt_llm's is {_word(decoupled)} (the BLS model streams what tensorrt_llm streams)")
    return problems + _history_chat(configs.get(HISTORY_CHAT), decoupled)


def _history_chat(config, llm_decoupled: bool) -> list[str]:
    """The history model answers plain infer requests and knows how tensorrt_llm answers it."""
    if config is None:
        return []
    where = f"{HISTORY_CHAT}/config.pbtxt"
    problems = [f"{where}: decoupled must be false (its clients send plain infer requests)"
                ] if config.model_transaction_policy.decoupled else []
    said = config.parameters[LLM_DECOUPLED].string_value.strip().lower() if LLM_DECOUPLED in config.parameters else ""
    if said not in ("true", "1", "false", "0") or (said in ("true", "1")) != llm_decoupled:
        problems.append(f"{where}: parameter {LLM_DECOUPLED} is {said!r}, but tensorrt_llm's decoupled is "
                        f"{_word(llm_decoupled)}")
    return problems


def _word(flag: bool) -> str:
    return "true" if flag else "false"
