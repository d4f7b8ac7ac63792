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
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankGroup:
    """This process's rank among `world_size` ranks of `group`."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `partial` (in place)."""
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


# PyTorch 2.13 renamed all_gather_into_tensor (older ones, as on some GPU hosts, have only that name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
