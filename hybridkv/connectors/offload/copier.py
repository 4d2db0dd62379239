"""BlockCopier: moves one block of one group between the KV buffers and a flat byte slot, one copy per span.

A block of group g is the pages of g's layers, in the group's layer order; in a slot they sit back to back
(`payload_bytes(g)` = the group's used bytes per block). Whatever the layout, the same block gives the same
payload, so a tier written under one layout serves the other. The spans come from `KVPlan.block_spans`:
packed gives one span per block (one copy moves every layer), per-layer one per region. KV-sharing consumers
own no pages and never appear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan


@dataclass(frozen=True)
class Span:
    buffer: int
    start: int  # byte offset of block 0's region in the buffer
    stride: int  # bytes from one block id to the next
    length: int
    at: int  # byte offset in the slot


class BlockCopier:
    def __init__(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        self.buffers = memory.buffers
        self.non_blocking = memory.device.type == "cuda"
        self.spans: list[tuple[Span, ...]] = [self._spans(plan, g.group_id) for g in plan.groups]

    @staticmethod
    def _spans(plan: KVPlan, group_id: int) -> tuple[Span, ...]:
        # Within a buffer every layer has the same block stride, so spans merge the same way for every block id.
        first, second = plan.block_spans(group_id, 0), plan.block_spans(group_id, 1)
        if [(b, n) for b, _, n in first] != [(b, n) for b, _, n in second]:
            raise ValueError(f"group {group_id}'s block spans differ between block ids; the layout is not strided")
        spans, at = [], 0
        for (buffer, start, length), (_, start1, _) in zip(first, second):
            spans.append(Span(buffer, start, start1 - start, length, at))
            at += length
        return tuple(spans)

    def payload_bytes(self, group_id: int) -> int:
        last = self.spans[group_id][-1]
        return last.at + last.length

    def copies_per_block(self, group_id: int) -> int:
        return len(self.spans[group_id])

    def to_slot(self, group_id: int, block_id: int, slot: torch.Tensor) -> int:
        """Device block -> slot bytes; returns the number of copies issued. On CUDA the copies are asynchronous:
        synchronize before reading the slot."""
        for s in self.spans[group_id]:
            src = self.buffers[s.buffer].narrow(0, s.start + block_id * s.stride, s.length)
            slot.narrow(0, s.at, s.length).copy_(src, non_blocking=self.non_blocking)
        return len(self.spans[group_id])

    def from_slot(self, group_id: int, block_id: int, slot: torch.Tensor) -> int:
        """Slot bytes -> device block; returns the number of copies issued (asynchronous on CUDA, as above)."""
        for s in self.spans[group_id]:
            dst = self.buffers[s.buffer].narrow(0, s.start + block_id * s.stride, s.length)
            dst.copy_(slot.narrow(0, s.at, s.length), non_blocking=self.non_blocking)
        return len(self.spans[group_id])
