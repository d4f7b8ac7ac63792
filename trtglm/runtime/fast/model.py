"""`FastModel`: ChatGLM3 on one GPU behind the `SlotModel` interface (slots.py), built for speed; a
tensor-parallel checkpoint runs one `FastModel` per GPU, one process each (parallel.py). This module
loads it, checks each call's arguments and picks the pass that runs it: the passes are passes.py's,
the warm-up and the CUDA graphs' capture graphs.py's.

- Paged KV cache (`PagedCache`, runtime/cache.py): per layer `[blocks, kv_heads, block_size,
  head]`, each slot's positions in the blocks its row of a block table names. A slot takes blocks
  as its sequence grows (before the pass that writes them) and frees them when released, so
  `kv_tokens` positions serve as many sequences as their lengths allow; on a GPU `kv_tokens` is
  what `kv_fraction` of the memory left after the weights holds (TensorRT-LLM's
  `kv_cache_free_gpu_mem_fraction`). An extra slot is scratch that padding rows of a decode step
  (and `score`) write into; padding past a sequence's blocks lands in a sink block.
- Decode steps, lone prompts and mixed steps of up to shapes.MIXED_GRAPH_TOKENS[-1] tokens replay
  CUDA graphs (graphs.py); prompt batches, chunks and longer steps run eagerly (passes.py).
- Weight-only int8 / int4 (linear.py) for the qkv, dense, fc and proj weights; Triton and Gluon
  matmuls (kernels.py, gluon_gemv.py).
- An FP8 checkpoint's qkv, dense, fc and proj run as FP8 matmuls (linear.py: torch._scaled_mm, static
  input scales from the checkpoint) and, where it asks for one, the KV cache holds FP8 keys and values at
  each layer's scale (half the bytes of a position: twice the positions in the same memory). Both need
  FP8 tensor cores (Ada, Hopper): elsewhere the model refuses to load, unless `emulate_fp8` (a stand-in
  for tests and dry runs on the CPU: the same arithmetic in float32).

The computation is `ShardedModel`'s (model.py): same RMSNorm, rotary, SwiGLU and checkpoint layout
([Q; K; V] rows, fc rows [up; gate]). At tp N each rank holds its own shard, the outputs of `dense` and
`proj` are summed across the ranks and the lm_head's vocabulary chunks gathered (parallel.py), inside the
CUDA graphs too; every rank must make the same calls in the same order (rank 0 takes the requests and the
others follow its steps: trtglm.runtime.distributed). At tp 1 there are no collectives at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trtglm.chatglm.config import kv_bytes_per_position
from trtglm.errors import UsageError
from trtglm.files import report_phase
from trtglm.conventions import FP8, FREE_GPU_MEM_FRACTION, INPUT_SCALE, KV_SCALE, TOKENS_PER_BLOCK, WEIGHT_SCALE
from trtglm.runtime.cache import PagedCache
from trtglm.runtime.checkpoint import CheckpointConfig, load_checkpoint
from trtglm.runtime.fast.graphs import GraphCapture
from trtglm.runtime.fast.linear import Linear, fp8_problem
from trtglm.runtime.fast.ops import TritonOps, select_ops
from trtglm.runtime.fast.parallel import RankGroup
from trtglm.runtime.fast.passes import ForwardPasses
from trtglm.runtime.fast.shapes import (MIXED_GRAPH_TOKENS, batch_buckets, check_shape_options, prefill_groups,
                                        prefill_widths, resolve_dtype, resolve_weight_only)
from trtglm.runtime.model import one_rank_checkpoint, rotary_tables
from trtglm.runtime.slots import check_copy, check_reuse, check_start, prefill_starts
from trtglm.runtime.transfer import upload

log = logging.getLogger(__name__)


@dataclass
class FastLayer:
    input_norm: torch.Tensor
    qkv: Linear
    dense: Linear
    post_norm: torch.Tensor
    fc: Linear
    proj: Linear


class FastModel(ForwardPasses, GraphCapture):
    """A ChatGLM3 `SlotModel` on one GPU over one rank's tensors of a TensorRT-LLM checkpoint: all of a tp-1 one, or
    this process's rank of a tp-N one with `process_group` (its N ranks, one per process)."""

    def __init__(self, cfg: CheckpointConfig, tensors: dict[str, torch.Tensor], *, num_slots: int = 64,
                 max_seq_len: int = 2048, dtype: str | torch.dtype | None = None, device: str | torch.device = "cuda",
                 weight_only: str | None = None, kernels: str = "auto", graphs: bool | None = None,
                 tune: bool | None = None, process_group: torch.distributed.ProcessGroup | None = None,
                 block_size: int = TOKENS_PER_BLOCK, kv_tokens: int | None = None,
                 kv_fraction: float = FREE_GPU_MEM_FRACTION, emulate_fp8: bool = False):
        self.device = torch.device(device)
        self.config, self.dtype = cfg, resolve_dtype(dtype, cfg)
        self.quant_algo = resolve_weight_only(weight_only, cfg)
        check_shape_options(cfg, num_slots, max_seq_len, self.device)
        self.emulate_fp8 = emulate_fp8
        check_fp8(cfg, self.device, emulate_fp8)
        self.cache_dtype = torch.float8_e4m3fn if cfg.fp8_kv_cache else self.dtype
        self.ranks = _rank_group(cfg, process_group, self.device, self.dtype)
        self.heads = cfg.heads_per_rank
        self.num_slots, self.max_seq_len, self.vocab_size = num_slots, max_seq_len, cfg.vocab_size
        self.ops = select_ops(self.device, kernels)
        # Timing the matmul kernels' block shapes costs seconds at start-up and pays on every step.
        self.tuned = isinstance(self.ops, TritonOps) and self.device.type == "cuda" if tune is None else tune
        self.scratch = num_slots  # the extra cache slot
        started = time.monotonic()
        self._load_weights(tensors, self.tuned)
        log.info("weights on %s in %.1f s", self.device, time.monotonic() - started)
        cos, sin = rotary_tables(cfg, torch.arange(max_seq_len, device=self.device)[None])
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        self.cache = PagedCache(cfg, num_slots, max_seq_len, self.cache_dtype, self.device, block_size,
                                kv_tokens or self._kv_tokens_that_fit(kv_fraction, block_size),
                                self._kv_scales(tensors))
        log.info("KV cache: %d positions in blocks of %d (%.1f GB)", self.cache.kv_tokens, block_size,
                 2 * sum(t.numel() * t.element_size() for t in self.cache.keys) / 1e9)
        self.buckets = batch_buckets(num_slots)
        self._tokens = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._slots = torch.full((num_slots,), self.scratch, dtype=torch.long, device=self.device)
        self._uploaded_slots: list[int] = []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill_widths = prefill_widths(max_seq_len)
        self._prefill_inputs = torch.zeros(2 + self.prefill_widths[-1], dtype=torch.long, device=self.device)
        self._prefill_positions = torch.arange(self.prefill_widths[-1], dtype=torch.int32, device=self.device)
        self.mixed_widths = list(MIXED_GRAPH_TOKENS)
        widest = self.mixed_widths[-1]
        self._mixed_tokens = torch.zeros(widest, dtype=torch.long, device=self.device)
        self._mixed_slots = torch.full((widest,), self.scratch, dtype=torch.long, device=self.device)
        self._mixed_positions = torch.zeros(widest, dtype=torch.int32, device=self.device)
        self._mixed_last = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_buffers: list[torch.Tensor] = []
        self._tuned_in_step = False
        if graphs is None:
            graphs = self.device.type == "cuda"
        if graphs:
            from trtglm.runtime.fast import kernel_cache  # needs Triton

            restored = self.tuned and kernel_cache.restore(self.device)
            report_phase("CUDA graphs" if restored or not self.tuned else "kernels: compiling and tuning (minutes)")
            self.capture_graphs()
            if self.tuned and not restored:
                kernel_cache.save(self.device)

    # --- loading -----------------------------------------------------------------------------------------------

    def _load_weights(self, tensors: dict[str, torch.Tensor], tune: bool) -> None:
        cfg, dtype = self.config, self.dtype
        use_triton = isinstance(self.ops, TritonOps)

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(self.device)

        def linear(prefix: str, bias: bool = False, quant_algo: str | None = self.quant_algo) -> Linear:
            bias_tensor = get(prefix + ".bias") if bias else None
            if quant_algo == FP8:
                return Linear.from_fp8(get(prefix + ".weight"), get(f"{prefix}.{WEIGHT_SCALE}"),
                                       get(f"{prefix}.{INPUT_SCALE}"), bias_tensor, dtype, self.emulate_fp8)
            layer = Linear.from_weight(get(prefix + ".weight"), bias_tensor, quant_algo, dtype, use_triton)
            layer.tune = tune
            return layer

        self.embedding = get("transformer.vocab_embedding.weight").to(dtype)
        self.final_norm = get("transformer.ln_f.weight").to(dtype)
        self.lm_head = linear("lm_head", quant_algo=None)
        self.layers = []
        for i in tqdm(range(cfg.num_layers), desc="load", unit="layer", disable=None, leave=False):
            p = f"transformer.layers.{i}."
            self.layers.append(FastLayer(
                input_norm=get(p + "input_layernorm.weight").to(dtype),
                qkv=linear(p + "attention.qkv", bias=cfg.add_qkv_bias),
                dense=linear(p + "attention.dense"),
                post_norm=get(p + "post_layernorm.weight").to(dtype),
                fc=linear(p + "mlp.fc"),
                proj=linear(p + "mlp.proj"),
            ))
        log.info("fast model: %d layers, %s%s, %.2f GB of weights read per decode step, %s kernels, on %s%s",
                 cfg.num_layers, str(dtype).removeprefix("torch."), _quantization(self), self.weight_bytes / 1e9,
                 self.ops.name, self.device,
                 f", rank {self.ranks.rank} of tp {self.ranks.world_size}" if self.ranks else "")

    def _kv_tokens_that_fit(self, fraction: float, block_size: int) -> int | None:
        """On a GPU, the positions `fraction` of its free memory holds (whole blocks; at most num_slots ×
        max_seq_len, at least one sequence); None elsewhere (that product)."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        fits = kv_positions(free, fraction, self.kv_bytes_per_position, block_size)
        fits = self.ranks.least(fits, self.device) if self.ranks else fits  # every rank's cache takes the same blocks
        return max(self.max_seq_len, min(fits, self.num_slots * self.max_seq_len))

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes one position of this rank's KV cache takes (keys and values of every layer)."""
        cfg = self.config
        return kv_bytes_per_position(cfg.num_layers, cfg.num_kv_heads, cfg.head_size, cfg.tp_size,
                                     self.cache_dtype.itemsize)

    def _kv_scales(self, tensors: dict[str, torch.Tensor]) -> list[float] | None:
        """An FP8 KV cache's scale per layer (from the checkpoint), else None."""
        if not self.config.fp8_kv_cache:
            return None
        return [float(tensors[f"transformer.layers.{i}.attention.{KV_SCALE}"]) for i in range(self.config.num_layers)]

    @property
    def kv_tokens(self) -> int:
        """Positions the KV cache holds for sequences (all slots together)."""
        return self.cache.kv_tokens

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def linears(self) -> list[Linear]:
        return [layer for w in self.layers for layer in (w.qkv, w.dense, w.fc, w.proj)] + [self.lm_head]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (every linear layer and the lm_head)."""
        return sum(layer.nbytes for layer in self.linears)

    # --- SlotModel ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], starts: Sequence[int] | None = None,
                use_graph: bool = True) -> torch.Tensor:
        """Run each prompt, or chunk of one, into its slot; float32 logits of each one's last position,
        [len(slots), vocab]. Prompt i holds positions starts[i]… of slot i (see SlotModel.prefill).

        A prompt prefilled alone from position 0 replays the prefill graph of the smallest width that holds it;
        `use_graph=False` launches its kernels one by one."""
        slots, prompts = list(slots), [list(p) for p in prompts]
        starts = prefill_starts(starts, len(prompts))
        self._check_prefill(slots, prompts, starts)
        self._hold(slots, starts, prompts)
        alone = len(prompts) == 1 and starts[0] == 0 and self._prefill_width(len(prompts[0])) is not None
        mixed = self._mixed(slots, prompts, starts) if use_graph and not alone else None
        if mixed is not None:  # prompts, or chunks, of a few hundred tokens together: one pass
            self.cache.set_lengths(slots, [start + len(prompt) for start, prompt in zip(starts, prompts)])
            return mixed
        order = sorted(range(len(prompts)), key=lambda i: (starts[i], -len(prompts[i])))
        rows: list[torch.Tensor | None] = [None] * len(prompts)
        for group in prefill_groups(order, [len(p) for p in prompts], starts):
            width = self._prefill_width(len(prompts[group[0]])) if use_graph else None
            if len(group) == 1 and starts[group[0]] == 0 and width is not None:
                logits = self._prefill_one(slots[group[0]], prompts[group[0]], width)
            else:
                logits = self._prefill_group([slots[i] for i in group], [prompts[i] for i in group], starts[group[0]])
            for i, row in zip(group, logits):
                rows[i] = row
        self.cache.set_lengths(slots, [start + len(prompt) for start, prompt in zip(starts, prompts)])
        return torch.stack(rows)

    @torch.no_grad()
    def decode(self, slots: Sequence[int], tokens: Sequence[int] | torch.Tensor, use_graph: bool = True
               ) -> torch.Tensor:
        """Append one token to each slot at its next position; float32 logits, [len(slots), vocab].

        `tokens` may be a device tensor (e.g. the argmax of the last logits): no host round trip.
        `use_graph=False` launches the step's kernels one by one (for profilers).
        """
        slots = list(slots)
        self._check_decode(slots, tokens)
        for slot in slots:
            self.cache.hold(slot, self.cache.lengths[slot] + 1)
        n = len(slots)
        bucket = next(b for b in self.buckets if b >= n)
        if slots != self._uploaded_slots:
            self._slots.copy_(upload(slots + [self.scratch] * (self.num_slots - n), self.device))
            self._uploaded_slots = slots
        token_ids = tokens if isinstance(tokens, torch.Tensor) else upload(list(tokens), self.device)
        self._tokens[:n].copy_(token_ids.reshape(-1), non_blocking=True)
        if use_graph and bucket in self._graphs:
            graph, logits = self._graphs[bucket]
            graph.replay()
            logits = logits[:n].clone()
        else:
            logits = self._decode_step(bucket)[:n]
        self.cache.advance(slots)
        return logits

    @torch.no_grad()
    def step(self, slots: Sequence[int], pieces: Sequence[Sequence[int] | None], starts: Sequence[int],
             decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One eager forward pass of every piece into its slot (see SlotModel.step): decode tokens (one-token
        pieces after the cached positions, or leading None pieces whose ids are `decode_ids`, on the device) and
        prompt chunks together; float32 logits of each last position."""
        given = 0 if decode_ids is None else len(decode_ids)
        if any(p is None for p in pieces[given:]) or any(p is not None for p in pieces[:given]):
            raise UsageError(f"a step's first {given} pieces, and only those, are None (decode_ids gives their ids)")
        slots, pieces = list(slots), [[0] if p is None else list(p) for p in pieces]  # 0: checked as an id
        starts = prefill_starts(starts, len(pieces))
        self._check_prefill(slots, pieces, starts)
        self._hold(slots, starts, pieces)
        logits = self._mixed(slots, pieces, starts, decode_ids)
        if logits is None:
            logits = self._packed_rows(pieces, slots, starts, decode_ids)
        self.cache.set_lengths(slots, [start + len(piece) for start, piece in zip(starts, pieces)])
        return logits

    @torch.no_grad()
    def prefill_all(self, slot: int, chunk: Sequence[int], start: int = 0) -> torch.Tensor:
        """One prompt chunk into its slot, run eagerly (no graph); float32 logits of every position (see
        SlotModel.prefill_all)."""
        slots, chunks = [slot], [list(chunk)]
        self._check_prefill(slots, chunks, [start])
        self._hold(slots, [start], chunks)
        logits = self._prefill_group(slots, chunks, start, all_positions=True)
        self.cache.set_lengths(slots, [start + len(chunks[0])])
        return logits

    def reuse(self, slot: int, source: int, length: int) -> None:
        """The slot holds the first `length` positions of `source`'s cache (see SlotModel.reuse)."""
        self._check_slot(slot)
        self._check_slot(source)
        check_reuse(slot, source, length, self.max_seq_len)
        self.cache.copy(slot, source, length)

    def release(self, slot: int, keep: int = 0) -> None:
        """Forget the slot's sequence (see SlotModel.release): its first `keep` positions stay cached, the rest of its
        KV-cache blocks are freed."""
        self._check_slot(slot)
        self.cache.reset(slot, keep)

    def _hold(self, slots: list[int], starts: list[int], pieces: list[list[int]]) -> None:
        """Each slot has KV-cache blocks for its piece (what a pass is about to write)."""
        for slot, start, piece in zip(slots, starts, pieces):
            self.cache.hold(slot, start + len(piece))

    @torch.no_grad()
    def copy(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Each target slot takes a copy of its source slot's sequence."""
        check_copy(sources, targets, self.num_slots)
        for source, target in zip(sources, targets):
            self.cache.copy(target, source, self.cache.lengths[source])

    @torch.no_grad()
    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced float32 logits `[T, vocab]` of one sequence (in the scratch slot; no slot is touched)."""
        tokens = list(tokens)
        if not 0 < len(tokens) <= self.max_seq_len:
            raise UsageError(f"score takes 1 to {self.max_seq_len} tokens, not {len(tokens)}")
        self._check_token_ids(tokens)
        return self._prefill_group([self.scratch], [tokens], all_positions=True)

    # --- checks ------------------------------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise UsageError(f"slot {slot!r} is not one of 0..{self.num_slots - 1}")

    def _check_slots(self, slots: list[int]) -> None:
        if not slots:
            raise UsageError("no slots given")
        for slot in slots:
            self._check_slot(slot)
        if len(set(slots)) != len(slots):
            raise UsageError("a slot appears twice in one call")

    def _check_token_ids(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _check_prefill(self, slots: list[int], prompts: list[list[int]], starts: list[int]) -> None:
        self._check_slots(slots)
        if len(slots) != len(prompts):
            raise UsageError(f"{len(slots)} slots but {len(prompts)} prompts")
        for slot, prompt, start in zip(slots, prompts, starts):
            check_start(slot, start, self.cache.lengths[slot])
            if not 0 < len(prompt) < self.max_seq_len - start:
                raise UsageError(f"a prompt has {len(prompt)} tokens; prompts take 1 to {self.max_seq_len - 1}"
                                 + (f" ({self.max_seq_len - 1 - start} after the {start} cached)" if start else ""))
            self._check_token_ids(prompt)

    def _check_decode(self, slots: list[int], tokens: Sequence[int] | torch.Tensor) -> None:
        self._check_slots(slots)
        if len(tokens) != len(slots):
            raise UsageError(f"{len(slots)} slots but {len(tokens)} tokens")
        for slot in slots:
            if self.cache.lengths[slot] == 0:
                raise UsageError(f"slot {slot} holds no sequence (prefill it first)")
            if self.cache.lengths[slot] >= self.max_seq_len:
                raise UsageError(f"slot {slot} is full ({self.max_seq_len} tokens)")
        if not isinstance(tokens, torch.Tensor):
            self._check_token_ids(tokens)



def load_fast_model(path: str | Path, rank: int | None = None, **options) -> FastModel:
    """A `FastModel` from a checkpoint folder: a tp-1 one, or with `rank` only that rank's file (and `options`'
    process_group joining the other ranks' processes); `options` as for `FastModel`."""
    ckpt = load_checkpoint(path) if rank is None else one_rank_checkpoint(path, rank)
    return FastModel(ckpt.config, ckpt.ranks[0], **options)


def kv_positions(free_bytes: int, fraction: float, bytes_per_position: int, block_size: int) -> int:
    """KV-cache positions (whole blocks) that `fraction` of `free_bytes` holds."""
    return int(free_bytes * fraction) // bytes_per_position // block_size * block_size


def check_fp8(cfg: CheckpointConfig, device: torch.device, emulate: bool) -> None:
    """An FP8 checkpoint (or KV cache) loads only where FP8 tensor cores are, or `emulate`d."""
    if not (cfg.fp8 or cfg.fp8_kv_cache) or emulate:
        return
    problem = fp8_problem(device)
    if problem:
        what = "FP8 weights and activations" if cfg.fp8 else "an FP8 KV cache"
        raise UsageError(f"the checkpoint has {what}, which the fast runtime runs on GPUs of compute capability 8.9 "
                         f"or later (Ada, Hopper), and {problem}: run it with TRTGLM_RUNTIME=portable (dequantized, "
                         f"slow) or convert it without FP8")


def _quantization(model: FastModel) -> str:
    cfg, how = model.config, " (emulated)" if model.emulate_fp8 else ""
    kv = f", FP8 KV cache{how}" if cfg.fp8_kv_cache else ""
    if model.quant_algo == FP8:
        return f", FP8 weights and activations{how}{kv}"
    return (f", weight-only {model.quant_algo}" if model.quant_algo else "") + kv


def _rank_group(cfg: CheckpointConfig, process_group: torch.distributed.ProcessGroup | None, device: torch.device,
                dtype: torch.dtype) -> RankGroup | None:
    """The collectives of a tp-N model (None at tp 1: no collectives, no extra work)."""
    if process_group is None:
        if cfg.tp_size != 1:
            raise UsageError(f"a tp_size {cfg.tp_size} checkpoint runs one rank per process: each needs its rank "
                             f"and the process group of all {cfg.tp_size} (trtglm launch --world-size {cfg.tp_size})")
        return None
    ranks = RankGroup(process_group, device, dtype)
    if ranks.world_size != cfg.tp_size:
        raise UsageError(f"a tp_size {cfg.tp_size} checkpoint needs {cfg.tp_size} ranks, not {ranks.world_size}")
    return ranks if ranks.world_size > 1 else None
