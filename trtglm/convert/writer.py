"""`trtglm convert`: ChatGLM HF weights → TensorRT-LLM checkpoint (config.json + rank{r}.safetensors).

Everything is checked before anything is written: options, config, every tensor's presence,
shape and dtype, and the tensor-parallel split of each. Then each source tensor is read
once and its rows go straight to their place in every rank file (all open at once, headers
computed up front from the plan): row ranges that keep their dtype and belong to one rank
are copied file to file inside the kernel; everything else (dtype changes, column splits,
tensors every rank holds) is read in blocks of rows and written to each rank, so memory
stays at a few blocks whatever the model size. The output is built in a temporary sibling folder
and renamed into place when complete.

With `fp8` the model is first calibrated on prompts (convert/fp8.py: one layer's weights read at a
time), then the quantized linears' weights are written in FP8, block by block, beside their scales.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from tqdm import tqdm

from trtglm.chatglm.config import TP_SIZES, ChatGLMConfig
from trtglm.conventions import DTYPES as DTYPE_NAMES
from trtglm.conventions import FP8, QUANT_ALGOS
from trtglm.convert.fp8 import Scales, calibrated_scales, calibration_prompt_ids, quantize_weight, scale_tensor, \
    weight_scale
from trtglm.convert.names import DROPPED, mapped_tensors
from trtglm.convert.safetensors_file import KernelCopyUnsupported, SafetensorsWriter
from trtglm.convert.source import TensorSource
from trtglm.convert.split import RULES, Selection
from trtglm.convert.staging import check_output, staged_output
from trtglm.errors import ModelFileError, UsageError
from trtglm.runtime.checkpoint import CheckpointConfig

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}  # TensorRT-LLM's names: torch's
# QUANT_ALGOS (conventions.py): the checkpoint only says which; TensorRT-LLM quantizes at build time
BLOCK_BYTES = 64 << 20  # source bytes copied per step
_SOURCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# TensorRT-LLM's model registry knows ChatGLM by these two architecture names.
_TRT_ARCHITECTURES = ("ChatGLMModel", "ChatGLMForCausalLM")


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: its HF source, its TensorRT-LLM name and what each rank holds."""

    hf: str
    trt: str
    shape: tuple[int, ...]  # the HF tensor's shape
    ranks: tuple[Selection, ...]
    quantized: bool = False  # an FP8 checkpoint holds it in FP8

    def rank_shape(self, rank: int) -> tuple[int, ...]:
        return self.ranks[rank].shape(self.shape)


@dataclass(frozen=True)
class WriteStats:
    tensors: int  # per rank
    bytes_read: int
    bytes_written: int
    seconds: float


def plan_conversion(cfg: ChatGLMConfig, tp_size: int) -> list[PlannedTensor]:
    """Every output tensor with its per-rank selection; raises UsageError if tp does not divide something."""
    return [PlannedTensor(m.hf, m.trt, m.shape, RULES[m.rule](m.shape, cfg, tp_size), m.quantized)
            for m in mapped_tensors(cfg)]


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, *, dtype: str, tp_size: int, pp_size: int,
                       weight_only: str | None, fp8: bool, fp8_kv_cache: bool, calibration_prompts: str | None,
                       chatglm_version: str, force: bool) -> Path:
    """Convert the ChatGLM HF checkpoint in `model_dir` into a TensorRT-LLM checkpoint at `output_dir`; `fp8`: with
    FP8 weights and activations (and `fp8_kv_cache`), calibrated on `calibration_prompts` (None: trtglm's own)."""
    _check_options(dtype, tp_size, pp_size, weight_only, fp8, fp8_kv_cache, calibration_prompts)
    model_dir, out = Path(model_dir), Path(output_dir)
    if not model_dir.is_dir():
        raise ModelFileError(f"{model_dir}: model folder not found")
    check_output(out, force, is_trtllm_checkpoint, "TensorRT-LLM checkpoint")
    cfg = ChatGLMConfig.from_model_dir(model_dir, chatglm_version)
    dtype_name = _resolve_dtype(dtype, cfg, weight_only, fp8)
    planned = plan_conversion(cfg, tp_size)
    config = trtllm_config(cfg, dtype_name, tp_size, pp_size, FP8 if fp8 else QUANT_ALGOS.get(weight_only),
                           FP8 if fp8_kv_cache else None)
    prompts = calibration_prompt_ids(calibration_prompts, model_dir, cfg.version) if fp8 else []
    with TensorSource(model_dir) as source:
        check_source(planned, source)
        scales = _calibrate(cfg, source, DTYPES[dtype_name], prompts, fp8_kv_cache) if fp8 else {}
        log.info("converting %s (%s, %d layers) from %s shards → %s, tp %d%s", model_dir, cfg.variant, cfg.num_layers,
                 source.format, dtype_name, tp_size, _quantization(weight_only, fp8, fp8_kv_cache))
        with staged_output(out) as tmp:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            stats = write_ranks(planned, source, tmp, DTYPES[dtype_name], tp_size, scales)
    gb = stats.bytes_written / 1e9
    log.info("wrote %s: %d tensors × %d rank(s), %.2f GB in %.1f s (%.2f GB/s written, %.2f GB read)", out,
             stats.tensors, tp_size, gb, stats.seconds, gb / max(stats.seconds, 1e-9), stats.bytes_read / 1e9)
    return out


def _quantization(weight_only: str | None, fp8: bool, fp8_kv_cache: bool) -> str:
    if fp8:
        return ", FP8 weights and activations" + (" and KV cache" if fp8_kv_cache else "")
    return f", weight-only {weight_only}" if weight_only else ""


def _calibrate(cfg: ChatGLMConfig, source: TensorSource, dtype: torch.dtype, prompts: list[list[int]],
               kv_cache: bool) -> Scales:
    """The FP8 scales from a calibration run over the source's tensors, each read whole when its layer comes."""
    whole = {p.trt: p for p in plan_conversion(cfg, 1)}

    def tensor(name: str) -> torch.Tensor:
        planned = whole[name]
        return planned.ranks[0].apply(source.rows(planned.hf, 0, planned.shape[0]).to(dtype))  # a copy: apply cuts

    tp1 = CheckpointConfig.from_dict(trtllm_config(cfg, "float32", 1, 1, None))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    found = calibrated_scales(tp1, tensor, prompts, kv_cache, device)
    log.info("FP8 scales from calibration on %s in %.1f s", device, time.perf_counter() - start)
    return found


def _check_options(dtype: str, tp_size: int, pp_size: int, weight_only: str | None, fp8: bool, fp8_kv_cache: bool,
                   calibration_prompts: str | None) -> None:
    if dtype != "auto" and dtype not in DTYPES:
        raise UsageError(f"--dtype must be auto, {', '.join(DTYPES)}; not {dtype!r}")
    if not _is_int(tp_size) or tp_size not in TP_SIZES:
        raise UsageError(f"--tp-size must be one of {', '.join(map(str, TP_SIZES))}; not {tp_size!r}")
    if not _is_int(pp_size) or pp_size != 1:
        raise UsageError(f"--pp-size must be 1 (TensorRT-LLM's ChatGLM models take no pipeline parallelism); "
                         f"not {pp_size!r}")
    if weight_only is not None and weight_only not in QUANT_ALGOS:
        raise UsageError(f"--weight-only must be {' or '.join(QUANT_ALGOS)}; not {weight_only!r}")
    if fp8 and weight_only:
        raise UsageError(f"--fp8 and --weight-only {weight_only} exclude one another (FP8 quantizes the weights itself)")
    if not fp8 and (fp8_kv_cache or calibration_prompts is not None):
        raise UsageError("--fp8-kv-cache and --calibration-prompts need --fp8")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve_dtype(dtype: str, cfg: ChatGLMConfig, weight_only: str | None, fp8: bool) -> str:
    """`auto` is the HF config's torch_dtype; weight-only kernels and FP8 matmuls give float16/bfloat16."""
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ModelFileError(f"config.json torch_dtype {name!r} is not one of {', '.join(DTYPES)}; pass --dtype")
    if (weight_only or fp8) and name == "float32":
        raise UsageError(f"{f'--weight-only {weight_only}' if weight_only else '--fp8'} needs --dtype float16 or "
                         "bfloat16, not float32")
    return name


def is_trtllm_checkpoint(folder: Path) -> bool:
    """A folder holding only config.json and rank*.safetensors (what `convert` writes)."""
    names = [p.name for p in folder.iterdir()]
    return "config.json" in names and all(n == "config.json" or (n.startswith("rank") and n.endswith(".safetensors"))
                                          for n in names)


def trtllm_config(cfg: ChatGLMConfig, dtype: str, tp_size: int, pp_size: int, quant_algo: str | None,
                  kv_cache_quant_algo: str | None = None) -> dict:
    """TensorRT-LLM's checkpoint config.json for a ChatGLM2/ChatGLM3 model."""
    linear_scaling = cfg.position_scale != 1.0  # ChatGLM2 applies rope_ratio to positions
    return {
        "architecture": cfg.architecture if cfg.architecture in _TRT_ARCHITECTURES else "ChatGLMForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_size": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "norm_epsilon": cfg.layernorm_epsilon,
        "vocab_size": cfg.vocab_size,
        "position_embedding_type": "rope_gptj",
        "max_position_embeddings": cfg.seq_length,
        "hidden_act": "swiglu",
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo},
        "mapping": {"world_size": tp_size * pp_size, "tp_size": tp_size, "pp_size": pp_size},
        "chatglm_version": cfg.version,
        "add_bias_linear": False,
        "add_qkv_bias": cfg.add_qkv_bias,
        "apply_query_key_layer_scaling": False,
        "apply_residual_connection_post_layernorm": False,
        "rmsnorm": True,
        "rotary_pct": 0.5,
        "rotary_base": cfg.rotary_base,
        "rotary_scaling": {"type": "linear", "factor": cfg.rope_ratio} if linear_scaling else None,
    }


def check_source(planned: list[PlannedTensor], source: TensorSource) -> None:
    """One-line ModelFileError naming missing, unexpected, mis-shaped or non-float tensors."""
    present = set(source.names())
    expected = {p.hf: p.shape for p in planned}
    problems = []
    missing = [name for name in expected if name not in present]
    unexpected = sorted(present - set(expected) - set(DROPPED))
    wrong_shape = [f"{name} {list(source.shape(name))} (expected {list(shape)})"
                   for name, shape in expected.items() if name in present and source.shape(name) != shape]
    not_float = [f"{name} {source.dtype(name)}" for name in expected
                 if name in present and source.dtype(name) not in _SOURCE_DTYPES]
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape),
                         ("not float16/bfloat16/float32", not_float)):
        if items:
            problems.append(f"{label}: {_first(items)}")
    if problems:
        raise ModelFileError(f"{source.weights.model_dir} does not match its config.json: {'; '.join(problems)}")


def _first(items: list[str], shown: int = 3) -> str:
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def write_ranks(planned: list[PlannedTensor], source: TensorSource, folder: Path, dtype: torch.dtype,
                tp_size: int, scales: Scales | None = None) -> WriteStats:
    """Write rank{r}.safetensors for every rank, reading each source tensor once; with FP8 `scales` (every rank's:
    convert/fp8.py) the quantized weights in FP8 and the scales beside them."""
    start = time.perf_counter()
    bytes_read, scales = 0, scales or {}

    def stored(p: PlannedTensor) -> torch.dtype:
        return torch.float8_e4m3fn if scales and p.quantized else dtype

    with ExitStack() as stack:
        writers = [stack.enter_context(SafetensorsWriter(
            folder / f"rank{r}.safetensors",
            [(p.trt, stored(p), p.rank_shape(r)) for p in planned] + [(name, torch.float32, (1,)) for name in scales],
            metadata={"format": "pt"})) for r in range(tp_size)]
        bars = [stack.enter_context(tqdm(total=w.size, desc=f"rank{r}", unit="B", unit_scale=True, position=r,
                                         leave=False, disable=None))
                for r, w in enumerate(writers)]
        for tensor in planned:
            scale = weight_scale(scales, tensor.trt) if scales and tensor.quantized else None
            bytes_read += copy_tensor(tensor, source, writers, dtype, bars, scale)
        for name, value in scales.items():
            for writer in writers:
                writer.write_rows(name, scale_tensor(value))
    written = sum(w.size for w in writers)
    return WriteStats(len(planned), bytes_read, written, time.perf_counter() - start)


def copy_tensor(tensor: PlannedTensor, source: TensorSource, writers: list[SafetensorsWriter], dtype: torch.dtype,
                bars: list[tqdm], fp8_scale: float | None = None) -> int:
    """Copy one source tensor into each rank's file, reading it once (in FP8 at `fp8_scale`); returns bytes read."""
    if fp8_scale is None and source.dtype(tensor.hf) == dtype and _rows_only_and_disjoint(tensor):
        try:
            return _copy_in_kernel(tensor, source, writers, bars)
        except KernelCopyUnsupported:
            pass  # e.g. bin shards, or across file systems
    return _copy_blocks(tensor, source, writers, dtype, bars, fp8_scale)


def _rows_only_and_disjoint(tensor: PlannedTensor) -> bool:
    """Each rank takes whole rows and no two ranks share one: every byte goes to one place."""
    full_width = (0, tensor.shape[1]) if len(tensor.shape) > 1 else None
    if any(s.cols not in (None, full_width) for s in tensor.ranks):
        return False
    ranges = sorted(r for s in tensor.ranks for r in s.rows)
    return all(prev[1] <= nxt[0] for prev, nxt in pairwise(ranges))


def _copy_in_kernel(tensor: PlannedTensor, source: TensorSource, writers: list[SafetensorsWriter],
                    bars: list[tqdm]) -> int:
    """Same dtype, whole rows: copy file to file with no user-space buffer (like `cp`)."""
    copied = 0
    for writer, selection, bar in zip(writers, tensor.ranks, bars, strict=True):
        dst = 0
        for start, stop in selection.rows:
            location = source.byte_range(tensor.hf, start, stop)
            if location is None:
                raise KernelCopyUnsupported("not a safetensors source")
            fd, offset, nbytes = location
            bar.update(writer.copy_rows_from(tensor.trt, fd, offset, nbytes, dst))
            copied += nbytes
            dst += stop - start
    return copied


def _copy_blocks(tensor: PlannedTensor, source: TensorSource, writers: list[SafetensorsWriter], dtype: torch.dtype,
                 bars: list[tqdm], fp8_scale: float | None = None) -> int:
    """Read blocks of rows once, convert (to FP8 at `fp8_scale` from `dtype`), and write each rank's part of each
    block."""
    n_rows = tensor.shape[0]
    row_bytes = source.dtype(tensor.hf).itemsize * math.prod(tensor.shape[1:])
    block = max(1, BLOCK_BYTES // row_bytes)
    bytes_read = 0
    for first in range(0, n_rows, block):
        last = min(n_rows, first + block)
        rows = source.rows(tensor.hf, first, last).to(dtype)
        if fp8_scale is not None:
            rows = quantize_weight(rows, fp8_scale)
        bytes_read += (last - first) * row_bytes
        for writer, selection, bar in zip(writers, tensor.ranks, bars, strict=True):
            bar.update(_write_overlap(writer, tensor.trt, selection, rows, first, last))
    return bytes_read


def _write_overlap(writer: SafetensorsWriter, name: str, selection: Selection, rows: torch.Tensor,
                   first: int, last: int) -> int:
    """Write the part of source rows [first, last) that `selection` keeps, at its place in the rank tensor."""
    written = 0
    dst = 0  # first row of the current source range in the rank tensor
    for start, stop in selection.rows:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            part = rows[lo - first:hi - first]
            if selection.cols is not None:
                part = part[:, selection.cols[0]:selection.cols[1]]
            written += writer.write_rows(name, part, dst + lo - start)
        dst += stop - start
    return written
