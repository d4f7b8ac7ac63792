"""`GraphCapture`: how `FastModel` (model.py) gets ready to serve — the warm-up that compiles the Triton kernels and
tunes the matmuls, the one-row layouts tuned again inside a decode step, and the capture of its CUDA graphs.

- Decode steps are captured as CUDA graphs, one per batch bucket (1, 2, 4, … num_slots); a
  step of n sequences replays the smallest bucket ≥ n. Slot indices, tokens and each
  slot's length live in device buffers the graph reads; the graph itself advances the
  lengths, so a steady decode loop uploads nothing but changed slot lists.
- A prompt prefilled alone from position 0 replays a graph of its padded width, a mixed step of up to
  shapes.MIXED_GRAPH_TOKENS[-1] tokens one of its token count (passes.py). The warm-up runs each eager
  shape class once too, so serving compiles nothing.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
from tqdm import tqdm

from trtglm.errors import UsageError
from trtglm.runtime.fast.shapes import DECODE_ATTENTION_POSITIONS, DECODE_CHUNK, eager_row_counts

log = logging.getLogger(__name__)

STEP_TUNING_MARGIN = 0.15  # one-row layouts this close to the fastest alone are timed again in a decode step


class GraphCapture:
    """`capture_graphs` and its warm-up, over the passes and input buffers `FastModel` sets up."""

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
        for pieces in eager_row_counts(self.num_slots):
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
