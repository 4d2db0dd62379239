"""BlockCopier: moves blocks of one group between the KV buffers and flat byte slots, one copy per span.

A block of group g is the pages of g's layers, in the group's layer order; in a slot they sit back to back
(`payload_bytes(g)` = the group's used bytes per block). Whatever the layout, the same block gives the same
payload, so a tier written under one layout serves the other. The spans come from `KVPlan.block_spans`:
packed gives one span per block (one copy moves every layer), per-layer one per region. KV-sharing consumers
own no pages and never appear. Group ids index the copier; so do the offload units of a recurrent-state entry's
later pages (G + 1 .. G + m - 1, one page each, copied as a page of the state group G).

`from_rows` moves many blocks at once: blocks and rows that advance in constant steps (a request's blocks are
mostly consecutive, and its slots were allocated in order) form a run, and a run moves in one strided copy per
span, instead of one small copy per block and span whose fixed cost dwarfs its bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        if plan.state is not None:  # offload units G + 1 .. G + m - 1: a state entry's later pages, copied alike
            self.spans += [self.spans[plan.state.group]] * (plan.state.num_pages - 1)

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

    def from_rows(self, group_id: int, block_ids: Sequence[int], rows: Sequence[int], src: torch.Tensor) -> int:
        """Row `rows[i]` of `src` (slots, uint8 of shape [n, >= payload]) -> block `block_ids[i]` of the group, for
        every i; returns the number of copies issued (asynchronous on CUDA, as above). Each run of blocks and rows
        that advance by constant positive steps is one copy per span."""
        copies = 0
        for first, count, block_step, row_step in runs(block_ids, rows):
            b0, r0 = block_ids[first], rows[first]
            for s in self.spans[group_id]:
                stride = block_step * s.stride
                dst = self.buffers[s.buffer].narrow(0, s.start + b0 * s.stride, (count - 1) * stride + s.length)
                if count > 1:
                    dst = dst.as_strided((count, s.length), (stride, 1))
                    part = src[r0 : r0 + (count - 1) * row_step + 1 : row_step, s.at : s.at + s.length]
                else:
                    part = src[r0, s.at : s.at + s.length]
                dst.copy_(part, non_blocking=self.non_blocking)
                copies += 1
        return copies


def runs(block_ids: Sequence[int], rows: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(first index, count, block step, row step) of maximal runs, in order, in which both sequences advance by
    constant positive steps; a lone pair is a run of one (steps 1)."""
    out: list[tuple[int, int, int, int]] = []
    n, i = len(block_ids), 0
    while i < n:
        j = i + 1
        if j < n and block_ids[j] > block_ids[i] and rows[j] > rows[i]:
            db, dr = block_ids[j] - block_ids[i], rows[j] - rows[i]
            while j + 1 < n and block_ids[j + 1] - block_ids[j] == db and rows[j + 1] - rows[j] == dr:
                j += 1
            out.append((i, j - i + 1, db, dr))
            i = j + 1
        else:
            out.append((i, 1, 1, 1))
            i = j
    return out
