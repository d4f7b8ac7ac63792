"""Tensor-parallel split rules: which source rows (and columns) each rank's tensor holds.

A rule maps a source tensor's shape to one `Selection` per rank: a list of source row
ranges in the order they appear in the rank's tensor, and an optional column range. Rules
are pure index arithmetic, so a conversion can be planned (and checked) without reading a
tensor, and the writer can copy any source rows straight to their place in each rank file.
Each rule checks that the tensor-parallel size divides what it splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trtglm.chatglm.config import ChatGLMConfig
from trtglm.errors import UsageError

Shape = tuple[int, ...]
Range = tuple[int, int]


@dataclass(frozen=True)
class Selection:
    """One rank's tensor: source rows `rows` (concatenated in order), then columns `cols`."""

    rows: tuple[Range, ...]
    cols: Range | None = None

    def shape(self, source: Shape) -> Shape:
        n_rows = sum(stop - start for start, stop in self.rows)
        if self.cols is None:
            return (n_rows, *source[1:])
        return (n_rows, self.cols[1] - self.cols[0], *source[2:])

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tensor cut from a whole source tensor (for small tensors and tests)."""
        out = torch.cat([tensor[start:stop] for start, stop in self.rows])
        return out if self.cols is None else out[:, self.cols[0]:self.cols[1]]


def _chunk(size: int, tp: int, rank: int, offset: int = 0) -> Range:
    step = size // tp
    return offset + rank * step, offset + (rank + 1) * step


def _require_divides(tp: int, size: int, what: str) -> None:
    if size % tp:
        raise UsageError(f"--tp-size {tp} does not divide {what} ({size})")


def whole(shape: Shape, cfg: ChatGLMConfig, tp: int) -> tuple[Selection, ...]:
    """Every rank holds the whole tensor (embedding, norms)."""
    return (Selection(((0, shape[0]),)),) * tp


def split_rows(shape: Shape, cfg: ChatGLMConfig, tp: int) -> tuple[Selection, ...]:
    """Rank r holds chunk r along dim 0 (lm_head: a slice of the vocabulary)."""
    _require_divides(tp, shape[0], "the rows of the output layer (vocabulary size)")
    return tuple(Selection((_chunk(shape[0], tp, r),)) for r in range(tp))


def split_cols(shape: Shape, cfg: ChatGLMConfig, tp: int) -> tuple[Selection, ...]:
    """Rank r holds chunk r along dim 1 (attention dense, mlp proj: row-parallel linears)."""
    _require_divides(tp, shape[1], "the input features of a row-parallel linear layer")
    return tuple(Selection(((0, shape[0]),), _chunk(shape[1], tp, r)) for r in range(tp))


def split_qkv(shape: Shape, cfg: ChatGLMConfig, tp: int) -> tuple[Selection, ...]:
    """Rows [Q; K; V] → per rank [Q_r; K_r; V_r].

    Q heads are split evenly. With fewer KV heads than ranks each KV head is repeated
    tp/kv times first, so rank r holds KV head r // (tp/kv): the one its query heads use.
    """
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    _require_divides(tp, heads, "the number of attention heads")
    if kv_heads % tp and tp % kv_heads:
        raise UsageError(f"--tp-size {tp} and the {kv_heads} KV heads (multi_query_group_num) must divide one another")
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    selections = []
    for rank in range(tp):
        if kv_heads >= tp:
            k, v = _chunk(kv_rows, tp, rank, q_rows), _chunk(kv_rows, tp, rank, q_rows + kv_rows)
        else:
            kv_head = rank // (tp // kv_heads)
            k = (q_rows + kv_head * head_dim, q_rows + (kv_head + 1) * head_dim)
            v = (k[0] + kv_rows, k[1] + kv_rows)
        selections.append(Selection((_chunk(q_rows, tp, rank), k, v)))
    return tuple(selections)


def split_swap_gate_up(shape: Shape, cfg: ChatGLMConfig, tp: int) -> tuple[Selection, ...]:
    """HF rows [gate; up] → per rank [up_r; gate_r] (TensorRT-LLM's swiglu takes the other order)."""
    if shape[0] % 2:
        raise UsageError(f"dense_h_to_4h has an odd number of rows ({shape[0]}); expected [gate; up]")
    ffn = shape[0] // 2
    _require_divides(tp, ffn, "the MLP inner size (ffn_hidden_size)")
    return tuple(Selection((_chunk(ffn, tp, r, ffn), _chunk(ffn, tp, r))) for r in range(tp))


Rule = Callable[[Shape, ChatGLMConfig, int], tuple[Selection, ...]]

RULES: dict[str, Rule] = {
    "whole": whole,
    "rows": split_rows,
    "cols": split_cols,
    "qkv": split_qkv,
    "swap_gate_up": split_swap_gate_up,
}
