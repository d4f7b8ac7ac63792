"""The collectives of a tensor-parallel `FastModel`: one rank per process (per GPU), over a torch.distributed
process group (NCCL on GPUs, gloo on the CPU).

Each rank holds its own `rank{r}.safetensors`: its query heads with their KV head (repeated on every rank
that shares it where tp exceeds the KV heads), the matching input columns of `dense`, its `[up; gate]`
rows of `fc` and the matching columns of `proj`, and its rows of `lm_head`. So the outputs of `dense`
and `proj` are partial sums, summed in place across the ranks (in the compute dtype: one rounding, as
after a tp-1 matmul), and the logits are the ranks' vocabulary chunks side by side.

Every call is a plain blocking collective on the current stream, so a decode step captured as a CUDA
graph captures its NCCL kernels with it (PyTorch's NCCL group neither queues captured work for its
watchdog nor lets it poll during a capture; NCCL requires that every rank captures, and replays, the
same collectives: the ranks run the same calls in the same order).

On GPUs, an all-reduce of a decode-sized message (up to ONE_SHOT_MAX_BYTES) is PyTorch's one-shot kernel
over symmetric memory instead: each rank writes its partial sums into a buffer every peer maps, and each
GPU reads all of them over NVLink and adds them up, one kernel with a barrier at each end (about a third
of NCCL's latency for these sizes). It needs no NVLink multicast, which stays off. Larger messages (long
prefills) stay with NCCL, whose ring moves fewer bytes per GPU. Every rank picks the same way for the
same message, so the ranks still run the same collectives in the same order.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist

from trtglm.conventions import keep_multicast_off

log = logging.getLogger(__name__)

# The most the one-shot kernel sums per rank (in its buffer's dtype): a `[128, 4096]` bfloat16 or `[64, 4096]` float16
# message (summed in float32). Measured on two H200s (docs/benchmarks.md): bfloat16 at 1 to 256 rows 6.7-21.5 µs
# against NCCL's 16-37.5; served float16 at batch 128 through the float32 buffer (2 MiB, its copies in and out) was
# slower than NCCL (18,398 tokens/s against 19,461).
ONE_SHOT_MAX_BYTES = 1024 * 1024
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # PyTorch's kernel's; float16 is summed in a float32 buffer
ONE_SHOT_SWITCH = "TRTGLM_ONE_SHOT_ALL_REDUCE"  # "0": NCCL for every message (on every rank: mpirun passes it on)


class RankGroup:
    """This process's rank among `world_size` ranks of `group`; on GPUs with `dtype` (the partial sums') the
    one-shot all-reduce for messages up to ONE_SHOT_MAX_BYTES, where every rank can have it."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.one_shot = None
        wanted = os.environ.get(ONE_SHOT_SWITCH, "1") != "0"
        if wanted and device.type == "cuda" and self.world_size > 1:
            self.one_shot = one_shot_all_reduce(group, device, dtype, ONE_SHOT_MAX_BYTES // summed_in(dtype).itemsize)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `partial` (in place)."""
        if self.one_shot is not None and self.one_shot.takes(partial):
            return self.one_shot(partial)
        dist.all_reduce(partial, group=self.group)
        return partial

    def least(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (what all ranks can agree on, e.g. the KV positions all can hold);
        `device`: this rank's, where the group's collectives run."""
        least = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.group)
        return int(least.item())

    def gather_columns(self, chunk: torch.Tensor) -> torch.Tensor:
        """`[rows, n]` of every rank → `[rows, world_size · n]`, rank 0's columns first."""
        rows, width = chunk.shape
        stacked = torch.empty(self.world_size * rows, width, dtype=chunk.dtype, device=chunk.device)
        _all_gather_single(stacked, chunk.contiguous(), group=self.group)  # the ranks' chunks one below the other
        return stacked.view(self.world_size, rows, width).transpose(0, 1).reshape(rows, self.world_size * width)


class OneShotAllReduce:
    """PyTorch's one-shot all-reduce over a symmetric-memory buffer of `numel` elements shared by the ranks of
    `group` (made by `one_shot_all_reduce`). Sums are taken in the buffer's dtype: the partial sums' own where
    PyTorch's kernel has it (bfloat16, float32), else float32 (float16: copied in and out, one rounding)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, numel: int):
        import torch.distributed._symmetric_memory as symm_mem

        keep_multicast_off(os.environ)  # read when symmetric memory is first set up, below
        group = group or dist.group.WORLD
        self.dtype, self.group_name = dtype, group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # older PyTorch needs it before a rendezvous
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group_name)
        self.buffer = symm_mem.empty(numel, dtype=summed_in(dtype), device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.sums = None if self.buffer.dtype == dtype else torch.empty_like(self.buffer)
        self._op = torch.ops.symm_mem

    def takes(self, partial: torch.Tensor) -> bool:
        """Whether `partial` fits (the same answer on every rank for the same message)."""
        return (partial.dtype == self.dtype and partial.numel() <= self.buffer.numel() and partial.is_contiguous()
                and partial.storage_offset() == 0)

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `partial` (in place)."""
        flat = partial.view(-1)
        shared = self.buffer[:flat.numel()]
        if self.sums is None:  # the kernel copies `flat` into the buffer itself
            self._op.one_shot_all_reduce_copy_out(shared, flat, "sum", self.group_name, flat)
        else:
            shared.copy_(flat)
            sums = self.sums[:flat.numel()]
            self._op.one_shot_all_reduce_out(shared, "sum", self.group_name, sums)
            flat.copy_(sums)
        return partial


def summed_in(dtype: torch.dtype) -> torch.dtype:
    """The dtype the one-shot kernel sums partial sums of `dtype` in."""
    return dtype if dtype in ONE_SHOT_DTYPES else torch.float32


def one_shot_all_reduce(group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype, numel: int
                        ) -> OneShotAllReduce | None:
    """The one-shot all-reduce on every rank of `group`, or None on every rank (where this PyTorch lacks it or one
    rank could not set it up: all ranks then use NCCL, as they must run the same collectives). Collective."""
    made, why = None, ""
    try:
        if hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
            made = OneShotAllReduce(group, device, dtype, numel)
        else:
            why = "this PyTorch has no one_shot_all_reduce_copy_out"
    except Exception as e:  # an alpha API: absent, or refused by this driver or GPU
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    every = torch.tensor([made is not None], dtype=torch.int32, device=device)
    dist.all_reduce(every, op=dist.ReduceOp.MIN, group=group)
    if not every.item():
        log.warning("all-reduce: NCCL for every message (%s)", why or "another rank has no one-shot all-reduce")
        return None
    log.info("all-reduce: one-shot over symmetric memory up to %d elements, NCCL beyond", numel)
    return made


# PyTorch 2.13 renamed all_gather_into_tensor (older ones, as on some GPU hosts, have only that name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
