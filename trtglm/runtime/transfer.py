"""Small host ↔ device transfers that never wait for the device's queued work.

The executor prepares step N+1 while the GPU runs step N, so nothing on its path may synchronise
with the GPU: PyTorch's plain copies from host lists do (`torch.tensor(values, device=...)` and
`tensor.copy_(host_tensor)` wait for the stream to drain). `upload` queues the copy behind the
stream's work instead, and `Download` brings results back when asked, not when launched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a tensor on `device`; on a GPU copied from pinned memory in stream order, without waiting
    (PyTorch's pinned allocator keeps the staging buffer until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Download:
    """A device tensor's values on their way to the host (into pinned memory, queued behind the work that makes
    them); `values()` waits for them."""

    def __init__(self, tensor: torch.Tensor):
        self._host = tensor.to("cpu", non_blocking=True)
        self._ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def values(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
