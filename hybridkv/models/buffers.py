"""Buffers kept from call to call. A fresh multi-MB tensor costs a page fault on each of its pages (glibc maps large
allocations and unmaps them again when freed; ~4 µs a fault in a VM); a kept buffer is faulted in once.

Two users, one cache each: the runner's attention gathers (`runner/attention.Workspace`, one per KV cache and run)
and the widened bfloat16 matmul (`models/widened.py`, one set per thread). A buffer over `max_bytes` is handed out
but not kept, so a rare huge step does not pin its memory for the life of the process."""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch


class BufferCache:
    """Reusable buffers by key, each grown to the largest size asked (times `headroom`: a context grows a token a
    step, and regrowing each step would fault as often as not keeping). A view's contents are undefined."""

    def __init__(self, max_bytes: int = 256 << 20, headroom: float = 1.0) -> None:
        if max_bytes < 0 or headroom < 1.0:
            raise ValueError(f"max_bytes must be >= 0 and headroom >= 1 (got {max_bytes}, {headroom})")
        self.max_bytes = max_bytes
        self.headroom = headroom
        self.buffers: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of `shape` of buffer `key`. Buffers are made outside inference mode: plain tensors, writable in
        and outside it."""
        need = math.prod(shape)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < need or buffer.dtype != dtype or buffer.device != device:
            with torch.inference_mode(False):
                buffer = torch.empty(int(need * self.headroom), dtype=dtype, device=device)
            if buffer.numel() * buffer.element_size() <= self.max_bytes:
                self.buffers[key] = buffer
        return buffer[:need].view(shape)

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
