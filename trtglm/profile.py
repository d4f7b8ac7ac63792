"""YAML profiles: one file is a complete recipe (model, convert, build, serve), checked up front.

A profile (configs/*.yaml) has four sections; every key is listed in the dataclasses below,
and anything else is an error. `load_profile` applies dotted-key overrides (`--set
build.max_batch_size=16`), then checks types, required keys and the rules TensorRT-LLM and
the model impose (input < sequence length, the 32k models' token limit,
weight-only needs fp16/bf16 activations, ...). Every problem is one line that names the
file and the key; nothing is converted or built before the profile is known to be good.

Paths: a relative `model.dir` in a profile is relative to the parent of the profile's
folder, which for configs/*.yaml is the repository root (so `tests/fixtures/tiny-chatglm3`
works from any working directory). A `model.dir` given as an override is used as given.
"""

from __future__ import annotations

import logging
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from trtglm.chatglm.config import TP_SIZES, ChatGLMConfig
from trtglm.chatglm.variants import VARIANTS, Variant
from trtglm.errors import ModelFileError, UsageError
from trtglm.conventions import DTYPES, FP8, FREE_GPU_MEM_FRACTION, MAX_NUM_TOKENS, QUANT_ALGOS, TOKENS_PER_BLOCK
from trtglm.ports import GRPC_PORT, HTTP_PORT, METRICS_PORT

log = logging.getLogger(__name__)

WEIGHT_ONLY = {None: None, **QUANT_ALGOS}  # profile value -> TensorRT-LLM quant_algo
PLUGIN_CHOICES = ("auto", "float16", "bfloat16", "float32", "disable")
# TensorRT-LLM's ChatGLM build refuses max_num_tokens ≥ 2**31 / (2 × ffn_hidden_size) for the
# rope-scaled 32k models (an int32 index overflow in the MLP); trtllm.md quotes it as 78398.
LONG_CONTEXT_TOKEN_LIMIT = 78398
# keys profiles no longer carry, being derived: one that a profile still has must agree, and is noted
DERIVED_KEYS = {"serve.world_size": "convert.tp_size × convert.pp_size"}


def _choices(*values: Any) -> dict:
    return {"choices": values}


def _at_least(minimum: int | float) -> dict:
    return {"min": minimum}


@dataclass(frozen=True)
class ModelSection:
    variant: str = field(metadata=_choices(*VARIANTS))
    dir: str | None = None  # HF model folder (absolute once loaded); --model-dir overrides it


@dataclass(frozen=True)
class ConvertSection:
    dtype: str = field(metadata=_choices(*DTYPES))
    tp_size: int = field(metadata=_choices(*TP_SIZES))
    pp_size: int = field(default=1, metadata=_choices(1))
    weight_only: str | None = field(default=None, metadata=_choices(*WEIGHT_ONLY))
    fp8: bool = False  # FP8 weights and activations (quant_algo FP8), their scales calibrated on prompts
    fp8_kv_cache: bool = False  # with fp8: the KV cache in FP8 too (kv_cache_quant_algo FP8)
    calibration_prompts: str | None = None  # with fp8: a prompt file (null: trtglm's own set); paths as model.dir


@dataclass(frozen=True)
class BuildSection:
    # auto: `build-engine` builds a TensorRT engine where trtllm-build is on PATH, else one for trtglm's runtime
    engine: str = field(metadata=_choices("auto", "tensorrt", "torch"))
    max_batch_size: int = field(metadata=_at_least(1))
    max_input_len: int = field(metadata=_at_least(1))
    max_seq_len: int = field(metadata=_at_least(2))
    max_num_tokens: int | None = field(default=None, metadata=_at_least(1))  # None: see _default_num_tokens
    max_beam_width: int = field(default=1, metadata=_at_least(1))
    kv_cache_type: str = field(default="paged", metadata=_choices("paged", "continuous"))
    gemm_plugin: str = field(default="auto", metadata=_choices(*PLUGIN_CHOICES))
    gpt_attention_plugin: str = field(default="auto", metadata=_choices(*PLUGIN_CHOICES))
    context_fmha: bool = True
    remove_input_padding: bool = True
    use_paged_context_fmha: bool = False
    tokens_per_block: int = field(default=TOKENS_PER_BLOCK, metadata=_at_least(1))


@dataclass(frozen=True)
class ServeSection:
    batching_strategy: str = field(default="inflight_fused_batching",
                                   metadata=_choices("inflight_fused_batching", "v1"))
    decoupled: bool = True  # streaming responses (needed for `stream: true`)
    preprocessing_instances: int = field(default=1, metadata=_at_least(1))
    postprocessing_instances: int = field(default=1, metadata=_at_least(1))
    # the BLS and history models answer one request per instance at a time (backend/bls.py says why): 0 gives them
    # one instance per sequence the engine runs at once (its max_batch_size)
    bls_instances: int = field(default=0, metadata=_at_least(0))
    kv_cache_free_gpu_mem_fraction: float = field(default=FREE_GPU_MEM_FRACTION, metadata={"min": 0.01, "max": 1.0})
    batch_scheduler_policy: str = field(default="guaranteed_no_evict",
                                        metadata=_choices("guaranteed_no_evict", "max_utilization"))
    max_queue_delay_microseconds: int = field(default=0, metadata=_at_least(0))
    max_queue_size: int = field(default=0, metadata=_at_least(0))
    # the most sequences one prompt may ask for (num_return_sequences, OpenAI's n and best_of): each is a request
    # of the engine's, so the count is bounded before any work
    max_return_sequences: int = field(default=8, metadata=_at_least(1))
    http_port: int = field(default=HTTP_PORT, metadata={"min": 1, "max": 65535})
    grpc_port: int = field(default=GRPC_PORT, metadata={"min": 1, "max": 65535})
    metrics_port: int = field(default=METRICS_PORT, metadata={"min": 1, "max": 65535})


SECTIONS = {"model": ModelSection, "convert": ConvertSection, "build": BuildSection, "serve": ServeSection}


@dataclass(frozen=True)
class Profile:
    name: str  # the file's stem; the default engine folder is engines/<name>
    path: str
    model: ModelSection
    convert: ConvertSection
    build: BuildSection
    serve: ServeSection

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.model.variant]

    @property
    def chatglm_version(self) -> str:
        return self.variant.chatglm_version

    @property
    def world_size(self) -> int:
        return self.convert.tp_size * self.convert.pp_size

    @property
    def quant_algo(self) -> str | None:
        return FP8 if self.convert.fp8 else WEIGHT_ONLY[self.convert.weight_only]

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return FP8 if self.convert.fp8_kv_cache else None

    def to_dict(self) -> dict:
        """The resolved recipe (defaults filled in, overrides applied), as written to trtglm.json."""
        return {name: asdict(getattr(self, name)) for name in SECTIONS}


def load_profile(path: str | Path, overrides: dict[str, Any] | None = None) -> Profile:
    """Read, override and validate a profile; raises UsageError/ModelFileError naming file and key."""
    where = str(path)
    raw = _read_yaml(Path(path))
    for key, value in (overrides or {}).items():
        _apply_override(raw, key, value, where)
    unknown = sorted(set(map(str, raw)) - set(SECTIONS))
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]} (sections: {', '.join(SECTIONS)})")
    derived = _take_derived(raw, where)
    sections = {name: _section(cls, raw.get(name), name, where) for name, cls in SECTIONS.items()}
    model = replace(sections["model"], dir=_resolve_path(sections["model"].dir, Path(path),
                                                         from_override="model.dir" in (overrides or {})))
    convert = replace(sections["convert"], calibration_prompts=_resolve_path(
        sections["convert"].calibration_prompts, Path(path),
        from_override="convert.calibration_prompts" in (overrides or {})))
    build = sections["build"]
    if build.max_num_tokens is None:
        build = replace(build, max_num_tokens=_default_num_tokens(build))
    profile = Profile(name=Path(path).stem, path=where, model=model, convert=convert,
                      build=build, serve=sections["serve"])
    _check_derived(profile, derived, where)
    _check_rules(profile, where)
    return profile


def parse_overrides(pairs: list[str] | tuple[str, ...] | str | None) -> dict[str, Any]:
    """`["build.max_batch_size=16", ...]` (from `--set`) -> {"build.max_batch_size": 16, ...}.

    Values are read as YAML (`16` -> int, `null` -> None, `true` -> bool, `a/b` -> str).
    """
    if pairs is None:
        return {}
    if isinstance(pairs, str):
        pairs = [pairs]
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = str(pair).partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {pair}: expected KEY=VALUE, e.g. build.max_batch_size=16")
        try:
            overrides[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise UsageError(f"--set {pair}: the value is not valid YAML") from None
    return overrides


# --- reading -------------------------------------------------------------------------------------


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: profile not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read profile ({e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise UsageError(f"{path}: not valid YAML{at} ({problem})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping with sections {', '.join(SECTIONS)}")
    return data


def _apply_override(raw: dict, key: str, value: Any, where: str) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name or "." in name:
        raise UsageError(f"{where}: --set {key}: expected SECTION.KEY with SECTION one of {', '.join(SECTIONS)}")
    known = [f.name for f in fields(SECTIONS[section])]
    if name not in known and key not in DERIVED_KEYS:
        raise UsageError(f"{where}: --set {key}: unknown key (known in {section}: {', '.join(known)})")
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise UsageError(f"{where}: {section} must be a mapping")
    target[name] = value


def _take_derived(raw: dict, where: str) -> dict[str, Any]:
    """The DERIVED_KEYS a profile still carries, taken out of `raw`."""
    taken = {}
    for key, source in DERIVED_KEYS.items():
        section, _, name = key.partition(".")
        if isinstance(raw.get(section), dict) and name in raw[section]:
            taken[key] = raw[section].pop(name)
            log.info("%s: %s is %s, derived; the profile need not give it", where, key, source)
    return taken


def _check_derived(p: Profile, derived: dict[str, Any], where: str) -> None:
    """UsageError when a derived key a profile gives disagrees with what it derives from."""
    c = p.convert
    world_size = derived.get("serve.world_size", p.world_size)
    if world_size != p.world_size:
        raise UsageError(f"{where}: serve.world_size ({world_size}) must equal convert.tp_size × convert.pp_size "
                         f"({c.tp_size} × {c.pp_size} = {p.world_size}); leave it out: it is derived")


def _section(cls: type, raw: Any, section: str, where: str):
    if raw is None:
        raise UsageError(f"{where}: missing section {section}")
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: {section} must be a mapping, not {_describe(raw)}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(map(str, raw)) - set(known))
    if unknown:
        raise UsageError(f"{where}: unknown key {section}.{unknown[0]} (known in {section}: {', '.join(known)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, spec in known.items():
        key = f"{section}.{name}"
        if name not in raw:
            if _is_required(spec):
                raise UsageError(f"{where}: missing required key {key}")
            continue
        values[name] = _checked_value(raw[name], hints[name], spec.metadata, key, where)
    return cls(**values)


def _is_required(spec) -> bool:
    return spec.default is MISSING and spec.default_factory is MISSING


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _checked_value(value: Any, hint: Any, rules: typing.Mapping, key: str, where: str) -> Any:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint)
    if value is None and optional:
        return None
    if not _has_type(value, base):
        raise UsageError(f"{where}: {key} must be {_TYPE_NAMES[base]}"
                         f"{' or null' if optional else ''}, not {_describe(value)}")
    value = float(value) if base is float else value
    if "choices" in rules and value not in rules["choices"]:
        choices = ", ".join("null" if c is None else str(c) for c in rules["choices"])
        raise UsageError(f"{where}: {key} must be one of {choices}, not {value!r}")
    if "min" in rules and value < rules["min"]:
        raise UsageError(f"{where}: {key} must be ≥ {rules['min']}, not {value}")
    if "max" in rules and value > rules["max"]:
        raise UsageError(f"{where}: {key} must be ≤ {rules['max']}, not {value}")
    return value


def _has_type(value: Any, base: type) -> bool:
    if base is bool or isinstance(value, bool):  # YAML true is not 1, and 1 is not true
        return base is bool and isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float))
    return isinstance(value, base)


def _describe(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def _resolve_path(given: str | None, profile_path: Path, from_override: bool) -> str | None:
    if given is None:
        return None
    path = Path(given).expanduser()
    if not path.is_absolute() and not from_override:
        path = profile_path.resolve().parent.parent / path
    return str(path.resolve())


def _default_num_tokens(build: BuildSection) -> int:
    """TensorRT-LLM's default, raised to fit one full prompt, capped at what the batch can hold."""
    return min(max(MAX_NUM_TOKENS, build.max_input_len), build.max_batch_size * build.max_seq_len)


# --- rules across keys ---------------------------------------------------------------------------


def _check_rules(p: Profile, where: str) -> None:
    b, c, s = p.build, p.convert, p.serve
    if b.max_input_len >= b.max_seq_len:
        raise UsageError(f"{where}: build.max_input_len ({b.max_input_len}) must be < build.max_seq_len ({b.max_seq_len})")
    if c.weight_only and c.dtype == "float32":
        raise UsageError(f"{where}: convert.weight_only ({c.weight_only}) needs convert.dtype float16 or bfloat16 "
                         "(TensorRT-LLM's weight-only kernels take half-precision activations), not float32")
    _check_fp8(c, where)
    capacity = b.max_batch_size * b.max_seq_len
    if b.max_num_tokens > capacity:
        raise UsageError(f"{where}: build.max_num_tokens ({b.max_num_tokens}) must be ≤ build.max_batch_size × "
                         f"build.max_seq_len ({capacity})")
    if b.max_num_tokens < b.max_input_len and not b.use_paged_context_fmha:
        raise UsageError(f"{where}: build.max_num_tokens ({b.max_num_tokens}) must be ≥ build.max_input_len "
                         f"({b.max_input_len}) unless build.use_paged_context_fmha is true (chunked prompts)")
    tokens = b.max_batch_size * b.max_beam_width * b.max_seq_len
    if p.variant.token_limit and tokens > LONG_CONTEXT_TOKEN_LIMIT:
        raise UsageError(f"{where}: build.max_batch_size × build.max_beam_width × build.max_seq_len "
                         f"({b.max_batch_size} × {b.max_beam_width} × {b.max_seq_len} = {tokens}) must be ≤ "
                         f"{LONG_CONTEXT_TOKEN_LIMIT} for {p.model.variant}")
    _check_engine_features(p, where)
    _check_ports(s, where)
    seq_length, source = model_seq_length(p)
    if seq_length is not None and b.max_seq_len > seq_length:
        raise UsageError(f"{where}: build.max_seq_len ({b.max_seq_len}) exceeds the model's seq_length "
                         f"({seq_length}, from {source})")


def _check_fp8(c: ConvertSection, where: str) -> None:
    if c.fp8 and c.weight_only:
        raise UsageError(f"{where}: convert.fp8 and convert.weight_only ({c.weight_only}) exclude one another "
                         "(FP8 quantizes the weights itself); set one")
    if c.fp8 and c.dtype == "float32":
        raise UsageError(f"{where}: convert.fp8 needs convert.dtype float16 or bfloat16 (the FP8 matmuls' output and "
                         "the unquantized layers), not float32")
    for key in ("fp8_kv_cache", "calibration_prompts"):
        if getattr(c, key) not in (None, False) and not c.fp8:
            raise UsageError(f"{where}: convert.{key} needs convert.fp8 true")


def _check_engine_features(p: Profile, where: str) -> None:
    b, s = p.build, p.serve
    if b.tokens_per_block & (b.tokens_per_block - 1):
        raise UsageError(f"{where}: build.tokens_per_block must be a power of two, not {b.tokens_per_block}")
    if b.use_paged_context_fmha and not (b.context_fmha and b.kv_cache_type == "paged"):
        raise UsageError(f"{where}: build.use_paged_context_fmha needs build.context_fmha true and "
                         "build.kv_cache_type paged")
    if s.batching_strategy == "inflight_fused_batching" and b.engine in ("tensorrt", "auto"):
        needs = {"build.kv_cache_type": b.kv_cache_type == "paged",
                 "build.remove_input_padding": b.remove_input_padding,
                 "build.gpt_attention_plugin": b.gpt_attention_plugin != "disable"}
        for key, ok in needs.items():
            if not ok:
                raise UsageError(f"{where}: serve.batching_strategy inflight_fused_batching needs a paged KV cache, "
                                 f"remove_input_padding and the GPT attention plugin; {key} is "
                                 f"{_yaml_word(getattr(b, key.split('.')[1]))}")


def _yaml_word(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_ports(s: ServeSection, where: str) -> None:
    ports = {"serve.http_port": s.http_port, "serve.grpc_port": s.grpc_port, "serve.metrics_port": s.metrics_port}
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port in seen:
            raise UsageError(f"{where}: {key} ({port}) is the same as {seen[port]}")
        seen[port] = key


def model_seq_length(p: Profile) -> tuple[int | None, str]:
    """The model's context length: from its HF config.json when readable, else the variant's."""
    config = read_model_config(p)
    if config is not None:
        return config.seq_length, f"{Path(p.model.dir) / 'config.json'}"
    return p.variant.seq_length, f"the {p.model.variant} variant"


def read_model_config(p: Profile) -> ChatGLMConfig | None:
    """The HF ChatGLMConfig of `p.model.dir`, or None when no config.json is there."""
    if p.model.dir is None or not (Path(p.model.dir) / "config.json").is_file():
        return None
    try:
        return ChatGLMConfig.from_model_dir(p.model.dir, version=p.chatglm_version)
    except ModelFileError as e:
        raise ModelFileError(f"{p.path}: model.dir: {e}") from None
