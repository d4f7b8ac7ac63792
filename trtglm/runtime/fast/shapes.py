"""What `FastModel` (model.py) settles before it touches the GPU: its checked options (dtype,
weight-only mode, batch and sequence limits), the decode batch sizes and prompt widths that get a
CUDA graph, and how prompts are grouped into padded prefill batches."""

from __future__ import annotations

import torch

from trtglm.errors import UsageError
from trtglm.conventions import QUANT_ALGOS
from trtglm.runtime.checkpoint import DTYPES, CheckpointConfig

# a weight-only mode by its name or its quant_algo's -> the quant_algo
WEIGHT_ONLY = {None: None, "none": None, **QUANT_ALGOS, **{algo: algo for algo in QUANT_ALGOS.values()}}
PREFILL_TOKENS = 8192  # tokens (padding included) per prefill forward pass
# Prompt lengths a one-prompt prefill is padded to, to replay a graph instead of launching ~400 kernels from
# Python (which, not the GPU, bounded a 512-token prefill); steps of at most a quarter above 256 tokens.
PREFILL_GRAPH_WIDTHS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def prefill_widths(max_seq_len: int) -> list[int]:
    """Prompt widths that get a prefill graph: PREFILL_GRAPH_WIDTHS below max_seq_len, then max_seq_len itself where
    it is not beyond them."""
    widths = [w for w in PREFILL_GRAPH_WIDTHS if w < max_seq_len]
    return widths + [max_seq_len] if max_seq_len <= PREFILL_GRAPH_WIDTHS[-1] else widths


# Token counts of the mixed steps replayed as CUDA graphs (a step of more tokens runs eagerly): every token attends
# through the decode kernel, which re-reads its slot's keys for each of a prompt chunk's tokens; the partial outputs
# of its split-K, kept for every token, grow with the count.
MIXED_GRAPH_TOKENS = (32, 64, 96, 128, 192, 256, 384, 512)
# An eager step whose tokens all sit below this position attends through the decode kernel, every token at once, as
# the mixed-step graphs do (one launch, however many prompt chunks); one with longer chunks takes flash attention,
# one chunk at a time.
DECODE_ATTENTION_POSITIONS = 2048
DECODE_CHUNK = 256  # positions per decode-attention program
ROW_BUCKETS = (1, 8, 16, 32, 64, 128)  # the matmuls' block shapes are chosen per bucket: rows up to each, then more


def row_bucket(rows: int) -> int:
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), ROW_BUCKETS[-1])


def eager_row_counts(limit: int) -> list[int]:
    """Row counts (1 to `limit`) that meet every compiled variant of the kernels an eager pass launches: one of each
    row bucket (the matmuls' block shapes) and, within it, of each kind of integer Triton compiles a kernel anew
    for (1, a multiple of 16, any other)."""
    kinds: dict[tuple[int, bool, bool], int] = {}
    for rows in range(1, limit + 1):
        kinds.setdefault((row_bucket(rows), rows == 1, rows % 16 == 0), rows)
    return sorted(kinds.values())


def batch_buckets(num_slots: int) -> list[int]:
    """Decode batch sizes that get a graph: powers of two below num_slots, and num_slots."""
    sizes, n = [], 1
    while n < num_slots:
        sizes.append(n)
        n *= 2
    return sizes + [num_slots]


def prefill_groups(order: list[int], lengths: list[int], starts: list[int] | None = None) -> list[list[int]]:
    """Consecutive prompts (longest first for each start) of one start whose padded batch stays within
    PREFILL_TOKENS."""
    groups: list[list[int]] = []
    for i in order:
        first = groups[-1][0] if groups else None
        if first is not None and (len(groups[-1]) + 1) * lengths[first] <= PREFILL_TOKENS \
                and (starts is None or starts[i] == starts[first]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def resolve_dtype(dtype: str | torch.dtype | None, cfg: CheckpointConfig) -> torch.dtype:
    if dtype is None:
        return cfg.torch_dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    name = aliases.get(dtype, dtype)
    if name not in DTYPES:
        raise UsageError(f"dtype must be one of bf16, fp16, {', '.join(DTYPES)}; not {dtype!r}")
    return DTYPES[name]


def resolve_weight_only(weight_only: str | None, cfg: CheckpointConfig) -> str | None:
    if weight_only is None:
        return cfg.quant_algo
    if cfg.fp8:
        raise UsageError(f"the checkpoint's weights are FP8 (quant_algo FP8): weight_only must be left unset, not "
                         f"{weight_only!r}")
    if weight_only not in WEIGHT_ONLY:
        raise UsageError(f"weight_only must be none, int8 or int4; not {weight_only!r}")
    return WEIGHT_ONLY[weight_only]


def check_shape_options(cfg: CheckpointConfig, num_slots: int, max_seq_len: int, device: torch.device) -> None:
    if num_slots < 1 or max_seq_len < 2:
        raise UsageError(f"need num_slots >= 1 and max_seq_len >= 2, not {num_slots} and {max_seq_len}")
    if max_seq_len > cfg.max_position_embeddings:
        raise UsageError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
    if cfg.heads_per_rank % cfg.kv_heads_per_rank:
        raise UsageError(f"{cfg.heads_per_rank} heads per rank are not a multiple of {cfg.kv_heads_per_rank} KV heads")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda requested but CUDA is not available")
