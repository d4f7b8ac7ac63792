"""`ForwardPasses`: the forward passes of `FastModel` (model.py) over the weights, the paged KV cache and the
input buffers it sets up; which pass a call takes, and the checks, are model.py's, the graphs' capture graphs.py's.

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
  and each chunk through SDPA.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from trtglm.runtime.fast.ops import slot_values
from trtglm.runtime.fast.shapes import DECODE_ATTENTION_POSITIONS
from trtglm.runtime.transfer import upload

PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # not cuDNN


class ForwardPasses:
    """The passes `FastModel` runs, each from its device inputs to float32 logits. Those named `…_padded` and
    `_decode_step` read only the model's input buffers (static shapes: what its CUDA graphs replay); `_mixed` and
    `_prefill_one` fill those buffers and replay a graph where one was captured."""

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
                                                 self.cache.values[i], self.cache.table, self.heads,
                                                 self.cache.scales[i])

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
            scale = self.cache.scales[i]
            q = self.ops.rope_cache(qkv, token_slots, token_positions, self.cos, self.sin, self.cache.keys[i],
                                    self.cache.values[i], self.cache.table, self.heads, scale)
            q = q.view(n, width, *q.shape[1:]).transpose(1, 2)
            keys = slot_values(self.cache.keys[i], self.cache.table, slot_ids, start + width, scale, q.dtype)
            values = slot_values(self.cache.values[i], self.cache.table, slot_ids, start + width, scale, q.dtype)
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
            keys, values, table, scale = self.cache.keys[i], self.cache.values[i], self.cache.table, self.cache.scales[i]
            q = self.ops.rope_cache(qkv, token_slots, token_positions, self.cos, self.sin, keys, values, table,
                                    self.heads, scale)
            if reach <= DECODE_ATTENTION_POSITIONS:
                return self.ops.decode_attention(q, keys, values, table, token_slots, token_positions, reach, scale)
            out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=dev)
            if single:
                out[single_rows] = self.ops.decode_attention(q[single_rows], keys, values, table,
                                                             token_slots[single_rows], token_positions[single_rows],
                                                             kv_scale=scale)
            for start, row, n in chunks:
                causal = {"is_causal": True} if start == 0 else {"attn_mask": causal_lower_right(n, start + n)}
                slot = token_slots[row:row + 1]
                with sdpa_kernel(PREFILL_ATTENTION):
                    attended = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None],
                                                              slot_values(keys, table, slot, start + n, scale, q.dtype),
                                                              slot_values(values, table, slot, start + n, scale,
                                                                          q.dtype),
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
        `_mixed_last` `[num_slots, vocab]` (static shapes: what a mixed-step graph replays)."""
        tokens, slots = self._mixed_tokens[:width], self._mixed_slots[:width]
        positions = self._mixed_positions[:width]

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            keys, values, table, scale = self.cache.keys[i], self.cache.values[i], self.cache.table, self.cache.scales[i]
            q = self.ops.rope_cache(qkv, slots, positions, self.cos, self.sin, keys, values, table, self.heads, scale)
            return self.ops.decode_attention(q, keys, values, table, slots, positions, kv_scale=scale)

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
        self._mixed_last.copy_(upload([end - 1 for end in ends] + [0] * (self.num_slots - len(pieces)), dev))
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


def _flattened(host_pieces: list[list[int]], slots: list[int], starts: list[int], lengths: list[int]
               ) -> tuple[list[int], list[int], list[int], list[int]]:
    """A pass's pieces as rows, one per token: the ids of `host_pieces` (those whose ids the host has: the last
    ones), then every row's slot and position, and where each piece's rows end."""
    ids = [t for piece in host_pieces for t in piece]
    slot_of = [slot for slot, n in zip(slots, lengths) for _ in range(n)]
    position_of = [start + i for start, n in zip(starts, lengths) for i in range(n)]
    return ids, slot_of, position_of, list(itertools.accumulate(lengths))
