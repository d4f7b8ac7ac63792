"""`FastModel`: ChatGLM3 on one GPU behind the `SlotModel` interface (slots.py), built for speed; a
tensor-parallel checkpoint runs one `FastModel` per GPU, one process each (parallel.py).

- Paged KV cache (`PagedCache`, runtime/cache.py): per layer `[blocks, kv_heads, block_size,
  head]`, each slot's positions in the blocks its row of a block table names. A slot takes blocks
  as its sequence grows (before the pass that writes them) and frees them when released, so
  `kv_tokens` positions serve as many sequences as their lengths allow; on a GPU `kv_tokens` is
  what `kv_fraction` of the memory left after the weights holds (TensorRT-LLM's
  `kv_cache_free_gpu_mem_fraction`). An extra slot is scratch that padding rows of a decode step
  (and `score`) write into; padding past a sequence's blocks lands in a sink block.
- Decode steps are captured as CUDA graphs, one per batch bucket (1, 2, 4, … max_batch); a
  step of n sequences replays the smallest bucket ≥ n. Slot indices, tokens and each
  slot's length live in device buffers the graph reads; the graph itself advances the
  lengths, so a steady decode loop uploads nothing but changed slot lists.
- Between the matmuls, one Triton kernel per step (ops.py / kernels.py): residual add +
  RMSNorm, rotary + KV-cache write, split-K decode attention over the two KV heads (at batch
  1 rotary, the cache write and attention in one kernel, one program per query head); SwiGLU
  either by the one-row `proj` matmul as it reads its input or by a kernel of its own,
  whichever the start-up tuning timed faster (kernels.tune).
- Prefill: prompts of similar length are right-padded into one batch (the padding's cache
  entries lie past each prompt's end, where the prompt's own next tokens overwrite them
  before anything reads them) and attend with PyTorch's SDPA (flash attention on the GPU,
  never cuDNN's, which builds a plan of about 40 ms for every new shape: every prompt
  length). Chunks that continue their slots from one start position share a batch too and
  attend to the cached positions before them through a lower-right causal bias. A prompt
  prefilled on its own from position 0 (the time to first token of a lone request) is
  padded to the next of shapes.PREFILL_GRAPH_WIDTHS and replays that width's CUDA graph; batches
  and chunks are launched eagerly.
- Mixed steps (`step`: the decode tokens of running slots and prompt chunks of others, as the
  in-flight executor schedules them; and prefills of several prompts or of chunks) of up to
  shapes.MIXED_GRAPH_TOKENS[-1] tokens replay a CUDA graph captured for the next of those token
  counts: every token, a decode token or one of a chunk, attends through the decode kernel to its
  slot's positions up to its own (the chunk's keys are written first), so one launch covers any mix
  of pieces and nothing in the step depends on the host but its input buffers. Longer steps run
  eagerly: the matmuls take every token at once, one-token pieces attend through the decode kernel
  and each chunk through SDPA. The warm-up runs each eager shape class once, so serving compiles
  nothing.
- Weight-only int8 / int4 (linear.py) for the qkv, dense, fc and proj weights; Triton and Gluon
  matmuls (kernels.py, gluon_gemv.py).

The computation is `ShardedModel`'s (model.py): same RMSNorm, rotary, SwiGLU and checkpoint layout
([Q; K; V] rows, fc rows [up; gate]). At tp N each rank holds its own shard, the outputs of `dense` and
`proj` are summed across the ranks and the lm_head's vocabulary chunks gathered (parallel.py), inside the
CUDA graphs too; every rank must make the same calls in the same order (rank 0 takes the requests and the
others follow its steps: trtglm.runtime.distributed). At tp 1 there are no collectives at all.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

from trtglm.errors import UsageError
from trtglm.files import report_phase
from trtglm.runtime.cache import KV_FRACTION, PagedCache
from trtglm.runtime.checkpoint import CheckpointConfig, load_checkpoint
from trtglm.runtime.fast.linear import Linear
from trtglm.runtime.fast.ops import TritonOps, select_ops, slot_positions
from trtglm.runtime.fast.parallel import RankGroup
from trtglm.runtime.fast.shapes import (DECODE_ATTENTION_POSITIONS, DECODE_CHUNK, MIXED_GRAPH_TOKENS, batch_buckets,
                                        check_shape_options, eager_row_counts, prefill_groups, prefill_widths,
                                        resolve_dtype, resolve_weight_only)
from trtglm.runtime.model import one_rank_checkpoint, rotary_tables
from trtglm.runtime.slots import check_copy, check_reuse, check_start, prefill_starts
from trtglm.runtime.transfer import upload

log = logging.getLogger(__name__)

STEP_TUNING_MARGIN = 0.15  # one-row layouts this close to the fastest alone are timed again in a decode step
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # not cuDNN


@dataclass
class FastLayer:
    input_norm: torch.Tensor
    qkv: Linear
    dense: Linear
    post_norm: torch.Tensor
    fc: Linear
    proj: Linear


class FastModel:
    """A ChatGLM3 `SlotModel` on one GPU over one rank's tensors of a TensorRT-LLM checkpoint: all of a tp-1 one, or
    this process's rank of a tp-N one with `process_group` (its N ranks, one per process)."""

    def __init__(self, cfg: CheckpointConfig, tensors: dict[str, torch.Tensor], *, max_batch: int = 64,
                 max_seq_len: int = 2048, dtype: str | torch.dtype | None = None, device: str | torch.device = "cuda",
                 weight_only: str | None = None, kernels: str = "auto", graphs: bool | None = None,
                 tune: bool | None = None, process_group: torch.distributed.ProcessGroup | None = None,
                 block_size: int = 64, kv_tokens: int | None = None, kv_fraction: float = KV_FRACTION):
        self.device = torch.device(device)
        self.config, self.dtype = cfg, resolve_dtype(dtype, cfg)
        self.quant_algo = resolve_weight_only(weight_only, cfg)
        check_shape_options(cfg, max_batch, max_seq_len, self.device)
        self.ranks = _rank_group(cfg, process_group)
        self.heads = cfg.heads_per_rank
        self.max_batch, self.max_seq_len, self.vocab_size = max_batch, max_seq_len, cfg.vocab_size
        self.ops = select_ops(self.device, kernels)
        # Timing the matmul kernels' block shapes costs seconds at start-up and pays on every step.
        self.tuned = isinstance(self.ops, TritonOps) and self.device.type == "cuda" if tune is None else tune
        self.scratch = max_batch  # the extra cache slot
        started = time.monotonic()
        self._load_weights(tensors, self.tuned)
        log.info("weights on %s in %.1f s", self.device, time.monotonic() - started)
        cos, sin = rotary_tables(cfg, torch.arange(max_seq_len, device=self.device)[None])
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        self.cache = PagedCache(cfg, max_batch, max_seq_len, self.dtype, self.device, block_size,
                                kv_tokens or self._kv_tokens_that_fit(kv_fraction, block_size))
        log.info("KV cache: %d positions in blocks of %d (%.1f GB)", self.cache.kv_tokens, block_size,
                 2 * sum(t.numel() * t.element_size() for t in self.cache.keys) / 1e9)
        self.buckets = batch_buckets(max_batch)
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._slots = torch.full((max_batch,), self.scratch, dtype=torch.long, device=self.device)
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
        self._mixed_last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
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
            layer = Linear.from_weight(get(prefix + ".weight"), get(prefix + ".bias") if bias else None, quant_algo,
                                       dtype, use_triton)
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
                 cfg.num_layers, str(dtype).removeprefix("torch."),
                 f", weight-only {self.quant_algo}" if self.quant_algo else "", self.weight_bytes / 1e9,
                 self.ops.name, self.device,
                 f", rank {self.ranks.rank} of tp {self.ranks.world_size}" if self.ranks else "")

    def _kv_tokens_that_fit(self, fraction: float, block_size: int) -> int | None:
        """On a GPU, the positions `fraction` of its free memory holds (whole blocks; at most max_batch ×
        max_seq_len, at least one sequence); None elsewhere (that product)."""
        if self.device.type != "cuda":
            return None
        cfg = self.config
        per_position = 2 * cfg.num_layers * cfg.kv_heads_per_rank * cfg.head_size * self.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        fits = int(free * fraction) // per_position // block_size * block_size
        fits = self.ranks.least(fits, self.device) if self.ranks else fits  # every rank's cache takes the same blocks
        return max(self.max_seq_len, min(fits, self.max_batch * self.max_seq_len))

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

    # --- the computation ---------------------------------------------------------------------------------------

    def _run_layers(self, x: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream `[T, hidden]` through every layer (`attend(layer, qkv rows)`: rotary, the cache write and
        attention); returns (stream, last layer's MLP output)."""
        cfg, ops, delta = self.config, self.ops, None
        total = self.ranks.all_reduce if self.ranks else None  # the ranks' partial sums of dense and proj
        for i, w in enumerate(self.layers):
            x, h = ops.add_rms_norm(x, delta, w.input_norm, cfg.norm_epsilon)
            delta = w.dense(attend(i, w.qkv(h)))
            if total:
                delta = total(delta)
            x, h = ops.add_rms_norm(x, delta, w.post_norm, cfg.norm_epsilon)
            delta = w.proj(w.fc(h), swiglu=True)
            if total:
                delta = total(delta)
        return x, delta

    def _logits(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        _, h = self.ops.add_rms_norm(x, delta, self.final_norm, self.config.norm_epsilon)
        logits = self.lm_head(h, out_dtype=torch.float32)
        return self.ranks.gather_columns(logits) if self.ranks else logits

    def _decode_step(self, n: int) -> torch.Tensor:
        """One token for each of the first n entries of the input buffers (static shapes: graph-capturable)."""
        slots = self._slots[:n]
        x, positions = self.ops.decode_inputs(self._tokens[:n], slots, self.cache.device_lengths, self.embedding,
                                                    self.scratch)

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            return self.ops.decode_qkv_attention(qkv, slots, positions, self.cos, self.sin, self.cache.keys[i],
                                                 self.cache.values[i], self.cache.table, self.heads)

        return self._logits(*self._run_layers(x, attend))

    def _prefill_group(self, slots: list[int], prompts: list[Sequence[int]], start: int = 0,
                       all_positions: bool = False) -> torch.Tensor:
        """Prompts (longest first) right-padded into one batch, each at positions start… of its slot; logits of
        each last position (or of all)."""
        width, dev = len(prompts[0]), self.device
        tokens = upload([t for prompt in prompts for t in [*prompt, *[0] * (width - len(prompt))]], dev)
        positions = torch.arange(start, start + width, device=dev, dtype=torch.int32)
        last = None if all_positions else upload([row * width + len(p) - 1 for row, p in enumerate(prompts)], dev)
        return self._prefill_rows(tokens, upload(slots, dev), positions, start, last)

    def _prefill_rows(self, tokens: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, start: int,
                      last: torch.Tensor | None) -> torch.Tensor:
        """The forward pass of a prefill batch: `tokens` `[n·width]` (row r at positions `positions` of slot
        slot_ids[r]); logits of the rows `last` (all rows if None). Device tensors only: graph-capturable."""
        n, width = slot_ids.shape[0], positions.shape[0]
        token_slots = slot_ids.repeat_interleave(width)
        token_positions = positions.repeat(n)
        # Queries sit at the end of the `start + width` keys each row attends to: SDPA's is_causal aligns them
        # to the top left, so a chunk after cached positions needs the lower-right bias.
        causal = {"is_causal": True} if start == 0 else {"attn_mask": causal_lower_right(width, start + width)}

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            q = self.ops.rope_cache(qkv, token_slots, token_positions, self.cos, self.sin, self.cache.keys[i],
                                    self.cache.values[i], self.cache.table, self.heads)
            q = q.view(n, width, *q.shape[1:]).transpose(1, 2)
            keys = slot_positions(self.cache.keys[i], self.cache.table, slot_ids, start + width)
            values = slot_positions(self.cache.values[i], self.cache.table, slot_ids, start + width)
            with sdpa_kernel(PREFILL_ATTENTION):
                out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **causal)
            return out.transpose(1, 2).reshape(n * width, -1)

        x, delta = self._run_layers(F.embedding(tokens, self.embedding), attend)
        if last is not None:
            x, delta = x[last], delta[last]
        return self._logits(x, delta)

    def _packed_rows(self, pieces: list[list[int]], slots: list[int], starts: list[int],
                     decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass of every piece at positions starts[i]… of slots[i]; logits of each last position. Below
        DECODE_ATTENTION_POSITIONS every token attends through the decode kernel in one launch; otherwise one-token
        pieces do, together, and longer ones each through SDPA. `decode_ids`: the ids of the first pieces (device
        tensor; their values in `pieces` are not read)."""
        dev, lengths = self.device, [len(p) for p in pieces]
        on_device = 0 if decode_ids is None else len(decode_ids)
        ids, slot_of, position_of, ends = _flattened(pieces[on_device:], slots, starts, lengths)
        tokens = upload(ids, dev)
        if decode_ids is not None:
            tokens = torch.cat([decode_ids.to(torch.long), tokens])
        token_slots, token_positions = upload(slot_of, dev), upload(position_of, dev, torch.int32)
        single = [i for i, n in enumerate(lengths) if n == 1]
        single_rows = upload([ends[i] - 1 for i in single], dev)
        chunks = [(starts[i], ends[i] - lengths[i], lengths[i]) for i, n in enumerate(lengths) if n > 1]
        reach = max(start + n for start, n in zip(starts, lengths))

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            keys, values, table = self.cache.keys[i], self.cache.values[i], self.cache.table
            q = self.ops.rope_cache(qkv, token_slots, token_positions, self.cos, self.sin, keys, values, table,
                                    self.heads)
            if reach <= DECODE_ATTENTION_POSITIONS:
                return self.ops.decode_attention(q, keys, values, table, token_slots, token_positions, reach)
            out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=dev)
            if single:
                out[single_rows] = self.ops.decode_attention(q[single_rows], keys, values, table,
                                                             token_slots[single_rows], token_positions[single_rows])
            for start, row, n in chunks:
                causal = {"is_causal": True} if start == 0 else {"attn_mask": causal_lower_right(n, start + n)}
                slot = token_slots[row:row + 1]
                with sdpa_kernel(PREFILL_ATTENTION):
                    attended = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None],
                                                              slot_positions(keys, table, slot, start + n),
                                                              slot_positions(values, table, slot, start + n),
                                                              enable_gqa=True, **causal)
                out[row:row + n] = attended[0].transpose(0, 1).reshape(n, -1)
            return out

        x, delta = self._run_layers(F.embedding(tokens, self.embedding), attend)
        last = upload([end - 1 for end in ends], dev)
        return self._logits(x[last], delta[last])

    def _mixed_padded(self, width: int) -> torch.Tensor:
        """The first `width` tokens of the mixed input buffers (each at its slot's position; padding at the scratch
        slot's position 0) in one pass, every token attending through the decode kernel to its slot's positions up
        to its own: a prompt chunk's causal attention, its keys written before they are read. Logits of the rows
        `_mixed_last` `[max_batch, vocab]` (static shapes: what a mixed-step graph replays)."""
        tokens, slots = self._mixed_tokens[:width], self._mixed_slots[:width]
        positions = self._mixed_positions[:width]

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            keys, values, table = self.cache.keys[i], self.cache.values[i], self.cache.table
            q = self.ops.rope_cache(qkv, slots, positions, self.cos, self.sin, keys, values, table, self.heads)
            return self.ops.decode_attention(q, keys, values, table, slots, positions)

        x, delta = self._run_layers(F.embedding(tokens, self.embedding), attend)
        return self._logits(x[self._mixed_last], delta[self._mixed_last])

    def _mixed(self, slots: list[int], pieces: list[list[int]], starts: list[int],
               decode_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """`_packed_rows` through the mixed input buffers, padded to the smallest of `mixed_widths` that holds it: its
        graph replayed where one was captured, else run eagerly; None when no width holds it."""
        lengths = [len(p) for p in pieces]
        total = sum(lengths)
        width = next((w for w in self.mixed_widths if w >= total), None)
        if width is None:
            return None
        pad, dev = width - total, self.device
        on_device = 0 if decode_ids is None else len(decode_ids)
        ids, slot_of, position_of, ends = _flattened(pieces[on_device:], slots, starts, lengths)
        if decode_ids is not None:
            self._mixed_tokens[:on_device].copy_(decode_ids)
        self._mixed_tokens[on_device:width].copy_(upload(ids + [0] * pad, dev))
        self._mixed_slots[:width].copy_(upload(slot_of + [self.scratch] * pad, dev))
        self._mixed_positions[:width].copy_(upload(position_of + [0] * pad, dev, torch.int32))
        self._mixed_last.copy_(upload([end - 1 for end in ends] + [0] * (self.max_batch - len(pieces)), dev))
        if width not in self._mixed_graphs:
            return self._mixed_padded(width)[:len(pieces)]
        graph, logits = self._mixed_graphs[width]
        graph.replay()
        return logits[:len(pieces)].clone()  # the next replay overwrites the graph's output

    def _prefill_padded(self, width: int) -> torch.Tensor:
        """The prompt of the prefill input buffer (slot, last position, then its tokens) right-padded to `width`:
        logits of its last position `[1, vocab]` (static shapes: what a prefill graph replays). The padding's cache
        entries lie past the prompt's end, where its own next tokens overwrite them before anything reads them."""
        slot, last, tokens = self._prefill_inputs[:1], self._prefill_inputs[1:2], self._prefill_inputs[2:2 + width]
        return self._prefill_rows(tokens, slot, self._prefill_positions[:width], 0, last)

    def _prefill_one(self, slot: int, prompt: list[int], width: int) -> torch.Tensor:
        """One prompt from position 0 of `slot`, right-padded to `width`: its graph replayed where one was captured
        (no launches from Python), else the same computation run eagerly; float32 logits `[1, vocab]`."""
        inputs = upload([slot, len(prompt) - 1, *prompt], self.device)
        self._prefill_inputs[:inputs.shape[0]].copy_(inputs)
        if width not in self._prefill_graphs:
            return self._prefill_padded(width)
        graph, logits = self._prefill_graphs[width]
        graph.replay()
        return logits.clone()  # the next replay overwrites the graph's output

    def _prefill_width(self, length: int) -> int | None:
        """The smallest prefill graph width that holds a prompt of `length` tokens, if any."""
        return next((w for w in sorted(self._prefill_graphs) if w >= length), None)

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
            self._slots.copy_(upload(slots + [self.scratch] * (self.max_batch - n), self.device))
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
        check_copy(sources, targets, self.max_batch)
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

    # --- CUDA graphs -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Warm up (compiles the Triton kernels, tunes the matmuls if asked) and capture one decode graph per bucket,
        one prefill graph per prompt width and one mixed-step graph per token count (in the scratch slot)."""
        if self.device.type != "cuda":
            raise UsageError("CUDA graphs need a CUDA device")
        self._slots.fill_(self.scratch)
        self._uploaded_slots = []
        self._prefill_inputs.zero_()
        self._prefill_inputs[0] = self.scratch
        self._mixed_tokens.zero_()
        self._mixed_slots.fill_(self.scratch)
        self._mixed_positions.zero_()
        self._mixed_last.zero_()
        started = time.monotonic()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for n in reversed(self.buckets):
                for _ in range(2):
                    self._decode_step(n)
            for width in reversed(self.prefill_widths):
                self._prefill_padded(width)
            for width in reversed(self.mixed_widths):
                self._mixed_padded(width)
            self._warm_eager_steps()
        torch.cuda.current_stream(self.device).wait_stream(side)
        warmed = time.monotonic()
        # In-step tuning times each rank's own choice of steps: ranks would disagree on how many (collectives) to run.
        if self.tuned and not self._tuned_in_step and not self.ranks:
            self._tune_in_step()
            self._tuned_in_step = True  # later captures (other launch settings) keep these layouts
        tuned = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        # With collectives, PyTorch's NCCL watchdog thread polls its events during the capture: only this thread's
        # calls must be capture-safe.
        capture = {"pool": pool, "capture_error_mode": "thread_local" if self.ranks else "global"}
        for graphs, sizes, run, what in ((self._graphs, self.buckets, self._decode_step, "decode"),
                                         (self._prefill_graphs, self.prefill_widths, self._prefill_padded, "prefill"),
                                         (self._mixed_graphs, self.mixed_widths, self._mixed_padded, "mixed")):
            for size in tqdm(list(reversed(sizes)), desc=f"capture {what}", unit="graph", disable=None, leave=False):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, **capture):
                    logits = run(size)
                graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        # The graphs replay the buffers they were captured with, even where a larger weight elsewhere replaces them.
        from trtglm.runtime.fast import kernels

        self._graph_buffers = kernels.dequantize_buffers()
        log.info("captured decode graphs for batch sizes %s, prefill graphs for prompts of up to %s tokens and mixed-step "
                 "graphs for up to %s tokens", ", ".join(map(str, self.buckets)), ", ".join(map(str, self.prefill_widths)),
                 ", ".join(map(str, self.mixed_widths)))
        log.info("start-up: kernels compiled and matmuls tuned while warming up in %.1f s, one-row layouts tuned in "
                 "the step in %.1f s, graphs captured in %.1f s", warmed - started, tuned - warmed,
                 time.monotonic() - tuned)

    def _warm_eager_steps(self) -> None:
        """Run the eager passes (mixed steps, prefills of several prompts) at every row count class they can meet, in
        the scratch slot, so that serving compiles and tunes nothing: each count of tokens with one prompt chunk, and
        each count of pieces (what the lm_head takes) with one token each but one."""
        scratch = self.scratch
        for tokens in eager_row_counts(min(self.max_seq_len - 1, DECODE_ATTENTION_POSITIONS)):
            self._packed_rows([[0] * tokens], [scratch], [0])
        for pieces in eager_row_counts(self.max_batch):
            self._packed_rows([[0]] * (pieces - 1) + [[0, 0]], [scratch] * pieces, [1] * (pieces - 1) + [0])
        reach = DECODE_CHUNK
        while reach <= min(DECODE_ATTENTION_POSITIONS, self.max_seq_len - 1):  # each count of its split-K partials
            self._packed_rows([[0] * reach], [scratch], [0])
            reach *= 2

    def _tune_in_step(self) -> None:
        """Choose each one-row matmul's layout again, among those `tune` timed close to the fastest alone, by timing
        the batch-1 decode step of the scratch slot as replayed graphs, one per layout, taking turns: alone on a cold
        L2 cache is not how a kernel runs in the step, where its weights are read while the kernel before finishes
        and other kernels' data stay in L2 (on an H200 this moved an int4 step by 0.01-0.07 ms)."""
        from trtglm.runtime.fast import kernels

        keys = sorted({key for layer in self.linears for key in layer.tuned_keys if key[1] == 1},
                      key=lambda key: -key[2] * key[3])  # the largest matrices first
        for key in keys:
            options = kernels.rivals(key, STEP_TUNING_MARGIN)
            if len(options) > 1:
                def step_with(config: kernels.AnyConfig, key: tuple = key) -> None:
                    kernels.CHOSEN[key] = config
                    self._decode_step(1)

                step_ms = dict(zip(options, kernels.warm_graph_times_ms([partial(step_with, c) for c in options])))
                kernels.CHOSEN[key] = min(step_ms, key=step_ms.get)
                log.debug("one-row layout for %s: %s (decode steps: %s)", key, kernels.CHOSEN[key], step_ms)

    # --- checks ------------------------------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_batch:
            raise UsageError(f"slot {slot!r} is not one of 0..{self.max_batch - 1}")

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


def _flattened(host_pieces: list[list[int]], slots: list[int], starts: list[int], lengths: list[int]
               ) -> tuple[list[int], list[int], list[int], list[int]]:
    """A pass's pieces as rows, one per token: the ids of `host_pieces` (those whose ids the host has: the last
    ones), then every row's slot and position, and where each piece's rows end."""
    ids = [t for piece in host_pieces for t in piece]
    slot_of = [slot for slot, n in zip(slots, lengths) for _ in range(n)]
    position_of = [start + i for start, n in zip(starts, lengths) for i in range(n)]
    return ids, slot_of, position_of, list(itertools.accumulate(lengths))


def load_fast_model(path: str | Path, rank: int | None = None, **options) -> FastModel:
    """A `FastModel` from a checkpoint folder: a tp-1 one, or with `rank` only that rank's file (and `options`'
    process_group joining the other ranks' processes); `options` as for `FastModel`."""
    ckpt = load_checkpoint(path) if rank is None else one_rank_checkpoint(path, rank)
    return FastModel(ckpt.config, ckpt.ranks[0], **options)


def _rank_group(cfg: CheckpointConfig, process_group: torch.distributed.ProcessGroup | None) -> RankGroup | None:
    """The collectives of a tp-N model (None at tp 1: no collectives, no extra work)."""
    if process_group is None:
        if cfg.tp_size != 1:
            raise UsageError(f"a tp_size {cfg.tp_size} checkpoint runs one rank per process: each needs its rank "
                             f"and the process group of all {cfg.tp_size} (trtglm launch --world-size {cfg.tp_size})")
        return None
    ranks = RankGroup(process_group)
    if ranks.world_size != cfg.tp_size:
        raise UsageError(f"a tp_size {cfg.tp_size} checkpoint needs {cfg.tp_size} ranks, not {ranks.world_size}")
    return ranks if ranks.world_size > 1 else None
