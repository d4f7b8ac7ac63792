"""Load and validate a TensorRT-LLM ChatGLM checkpoint folder (`config.json` + `rank{r}.safetensors`).

Validation is strict, like TensorRT-LLM's loader: every config key the runtime needs must be
present and consistent, every rank file must exist, and every tensor of every rank must be
there with the shape its tensor-parallel split gives (missing, extra or mis-shaped tensors
are `ModelFileError`s naming the tensor). Tensors are returned per rank exactly as written, but
that FP8 weights stored as int8 (TensorRT-LLM reads either: `preprocess_weights` in its
models/modeling_utils.py views them as float8_e4m3fn) come back as float8_e4m3fn.

An FP8 checkpoint (quant_algo FP8) holds each quantized linear's weight in float8_e4m3fn beside its
`weights_scaling_factor` and `activation_scaling_factor`, and with kv_cache_quant_algo FP8 each layer's
`attention.kv_cache_scaling_factor` (conventions.py): float32 of shape [1], positive and finite, else
the checkpoint is refused naming the scale. A `kv_cache_rcp_scaling_factor` (1 / the scale, which
TensorRT-LLM derives where a converter leaves it out) is accepted and not used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from trtglm.chatglm.config import ARCHITECTURES, kv_heads_per_rank
from trtglm.conventions import DTYPES as DTYPE_NAMES
from trtglm.conventions import FP8, INPUT_SCALE, KV_SCALE, WEIGHT_SCALE
from trtglm.conventions import QUANT_ALGOS as TRTLLM_QUANT_ALGOS
from trtglm.errors import ModelFileError
from trtglm.files import read_json_object

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # torch's names are TensorRT-LLM's
QUANT_ALGOS = (None, *TRTLLM_QUANT_ALGOS.values(), FP8)
KV_CACHE_QUANT_ALGOS = (None, FP8)
QUANTIZED_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")  # per layer (lm_head is not)
KV_RCP_SCALE = "kv_cache_rcp_scaling_factor"

_REQUIRED_KEYS = ("architecture", "dtype", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "hidden_size", "intermediate_size", "norm_epsilon", "vocab_size", "max_position_embeddings",
                  "mapping")


@dataclass(frozen=True)
class CheckpointConfig:
    """The fields of a checkpoint's `config.json` that define the computation and the split."""

    architecture: str
    dtype: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    head_size: int
    max_position_embeddings: int
    norm_epsilon: float
    quant_algo: str | None
    tp_size: int
    kv_cache_quant_algo: str | None = None
    chatglm_version: str = "chatglm3"
    add_qkv_bias: bool = True
    rotary_pct: float = 0.5
    rotary_base: float = 10000.0
    position_scale: float = 1.0  # linear rotary scaling: positions are divided by it

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.tp_size)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.rotary_pct)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def fp8(self) -> bool:
        return self.quant_algo == FP8

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_quant_algo == FP8

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config.json") -> "CheckpointConfig":
        missing = [k for k in _REQUIRED_KEYS if k not in cfg]
        if missing:
            raise ModelFileError(f"{where}: missing key(s) {', '.join(missing)}")
        try:
            out = cls(
                architecture=str(cfg["architecture"]),
                dtype=str(cfg["dtype"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                head_size=int(cfg.get("head_size") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])),
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                norm_epsilon=float(cfg["norm_epsilon"]),
                quant_algo=(cfg.get("quantization") or {}).get("quant_algo"),
                tp_size=int(cfg["mapping"].get("tp_size", 1)),
                kv_cache_quant_algo=(cfg.get("quantization") or {}).get("kv_cache_quant_algo"),
                chatglm_version=str(cfg.get("chatglm_version", "chatglm3")),
                add_qkv_bias=bool(cfg.get("add_qkv_bias", True)),
                rotary_pct=float(cfg.get("rotary_pct", 0.5)),
                **_rotary(cfg),
            )
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            raise ModelFileError(f"{where}: malformed value ({e})") from None
        _check_config(out, cfg["mapping"], where)
        return out


def _rotary(cfg: dict) -> dict:
    """rotary_base / linear scaling; v0.9 checkpoints wrote `rope_ratio` instead."""
    scaling = cfg.get("rotary_scaling")
    if "rotary_base" not in cfg and "rope_ratio" in cfg:
        ratio = float(cfg["rope_ratio"] or 1.0)
        if cfg.get("chatglm_version", "chatglm3") == "chatglm2":
            return {"rotary_base": 10000.0, "position_scale": ratio}
        return {"rotary_base": 10000.0 * ratio, "position_scale": 1.0}
    if scaling is not None and (not isinstance(scaling, dict) or scaling.get("type") != "linear"):
        raise ValueError(f"unsupported rotary_scaling {scaling!r} (only linear)")
    return {"rotary_base": float(cfg.get("rotary_base", 10000.0)),
            "position_scale": float(scaling["factor"]) if scaling else 1.0}


def _check_config(cfg: CheckpointConfig, mapping: dict, where: str) -> None:
    tp, problems = cfg.tp_size, []
    if cfg.architecture not in ARCHITECTURES:
        problems.append(f"architecture {cfg.architecture!r} is not ChatGLM")
    if cfg.dtype not in DTYPES:
        problems.append(f"dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.quant_algo not in QUANT_ALGOS:
        supported = ", ".join(map(str, QUANT_ALGOS[1:]))
        problems.append(f"quant_algo {cfg.quant_algo!r} is not supported (null, {supported})")
    if cfg.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        problems.append(f"kv_cache_quant_algo {cfg.kv_cache_quant_algo!r} is not supported (null, {FP8})")
    if int(mapping.get("pp_size", 1)) != 1:
        problems.append(f"pp_size {mapping.get('pp_size')} is not supported (ChatGLM uses pp_size 1)")
    if int(mapping.get("world_size", tp)) != tp * int(mapping.get("pp_size", 1)):
        problems.append(f"mapping world_size {mapping.get('world_size')} != tp_size × pp_size")
    if tp < 1 or cfg.num_heads % tp or cfg.intermediate_size % tp or cfg.vocab_size % tp:
        problems.append(f"tp_size {tp} does not divide the heads, intermediate size and vocabulary")
    elif cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"tp_size {tp} and {cfg.num_kv_heads} KV heads: one must divide the other")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_size:
        problems.append(f"rotary_pct {cfg.rotary_pct} gives an invalid rotary dimension")
    if problems:
        raise ModelFileError(f"{where}: {problems[0]}")


def expected_shapes(cfg: CheckpointConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor one rank must hold (the same on every rank)."""
    h, d = cfg.hidden_size, cfg.head_size
    q, kv, ffn = cfg.heads_per_rank * d, cfg.kv_heads_per_rank * d, cfg.intermediate_size // cfg.tp_size
    shapes = {"transformer.vocab_embedding.weight": (cfg.vocab_size, h),
              "transformer.ln_f.weight": (h,),
              "lm_head.weight": (cfg.vocab_size // cfg.tp_size, h)}
    for layer in range(cfg.num_layers):
        p = f"transformer.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "attention.qkv.weight"] = (q + 2 * kv, h)
        if cfg.add_qkv_bias:
            shapes[p + "attention.qkv.bias"] = (q + 2 * kv,)
        shapes[p + "attention.dense.weight"] = (h, q)
        shapes[p + "post_layernorm.weight"] = (h,)
        shapes[p + "mlp.fc.weight"] = (2 * ffn, h)
        shapes[p + "mlp.proj.weight"] = (h, ffn)
        shapes.update({name: (1,) for name in scale_names(cfg, layer)})
    return shapes


def scale_names(cfg: CheckpointConfig, layer: int) -> list[str]:
    """The FP8 scales one rank holds for `layer` (none unquantized)."""
    p = f"transformer.layers.{layer}."
    names = [f"{p}{linear}.{kind}" for linear in QUANTIZED_LINEARS for kind in (WEIGHT_SCALE, INPUT_SCALE)] \
        if cfg.fp8 else []
    return names + [p + f"attention.{KV_SCALE}"] if cfg.fp8_kv_cache else names


def fp8_weight_names(cfg: CheckpointConfig) -> set[str]:
    """The weights an FP8 checkpoint holds in float8_e4m3fn."""
    return {f"transformer.layers.{layer}.{linear}.weight" for layer in range(cfg.num_layers)
            for linear in QUANTIZED_LINEARS} if cfg.fp8 else set()


@dataclass
class Checkpoint:
    path: Path
    config: CheckpointConfig
    ranks: list[dict[str, torch.Tensor]]  # rank -> name -> tensor, as stored


def read_config(path: str | Path) -> CheckpointConfig:
    file = Path(path) / "config.json"
    data = read_json_object(file, "file not found (not a TensorRT-LLM checkpoint folder)")
    return CheckpointConfig.from_dict(data, str(file))


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate a checkpoint folder; tensors stay in their stored dtype on the CPU."""
    path = Path(path)
    cfg = read_config(path)
    ranks = [load_rank(path / f"rank{r}.safetensors", cfg) for r in range(cfg.world_size)]
    extra = sorted(p.name for p in path.glob("rank*.safetensors")
                   if p.name not in {f"rank{r}.safetensors" for r in range(cfg.world_size)})
    if extra:
        raise ModelFileError(f"{path}: {extra[0]} does not belong to a tp_size {cfg.tp_size} checkpoint")
    log.debug("loaded %s: %d rank(s), %d tensors each", path, len(ranks), len(ranks[0]))
    return Checkpoint(path, cfg, ranks)


def load_rank(file: Path, cfg: CheckpointConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shapes = expected_shapes(cfg)
    if not file.is_file():
        raise ModelFileError(f"{file}: rank file not found")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFileError(f"{file}: cannot read ({first_line})") from None
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{file}: missing tensor {missing[0]}{more}")
    extra = sorted(n for n in tensors if n not in shapes and not (cfg.fp8_kv_cache and n.endswith(KV_RCP_SCALE)))
    if extra:
        hint = " (pre-quantized weights are not supported: write float weights and set quant_algo)" \
            if any(n.endswith("per_channel_scale") for n in extra) else ""
        raise ModelFileError(f"{file}: unexpected tensor {extra[0]}{hint}")
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ModelFileError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    fp8_weights = fp8_weight_names(cfg)
    for name in fp8_weights:
        if tensors[name].dtype == torch.int8:
            tensors[name] = tensors[name].view(torch.float8_e4m3fn)
    for name, tensor in tensors.items():
        scale = name.endswith((WEIGHT_SCALE, INPUT_SCALE, KV_SCALE, KV_RCP_SCALE))
        dtypes, what = ((torch.float8_e4m3fn,), "float8_e4m3fn (quant_algo FP8)") if name in fp8_weights else \
            ((torch.float32,), "float32") if scale else (_FLOATS, "a float type")
        if tensor.dtype not in dtypes:
            raise ModelFileError(f"{file}: tensor {name} has dtype {tensor.dtype}, expected {what}")
        if scale and not (torch.isfinite(tensor).all() and (tensor > 0).all()):
            raise ModelFileError(f"{file}: scale {name} is {tensor.tolist()}, not a positive finite number")
    return tensors


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
