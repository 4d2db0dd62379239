"""Transfer descriptors from the KVPlan: which byte ranges move when block b of group g moves, on both sides.

Each side describes where every owner layer keeps its pages: (address of block 0's page, block stride). Block b
of group g is the pages of the group's layers, in the group's layer order, so local and remote pages pair one to
one whatever each side's layout. Consecutive pairs merge while both sides stay contiguous: packed to packed moves
one descriptor per block (or per run of consecutive block ids on both sides), per-layer one per region, mixed
layouts one per layer page. KV-sharing consumers own no pages and never appear.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hybridkv.kv.plan import KVPlan

Region = tuple[int, int, int, int]  # (start in the block's S bytes, address of block 0's piece, stride, width)


@dataclass(frozen=True)
class Placement:
    """layer -> (address of its block-0 page, block stride in bytes), for every owner layer of one instance; and,
    for a plan with recurrent state, `regions`: where each piece of a block id's S bytes lies (state pages are
    whole blocks, paired byte range by byte range). Regions are in start order and tile [0, S)."""

    layers: Mapping[int, tuple[int, int]]
    regions: tuple[Region, ...] = ()

    @staticmethod
    def of(plan: KVPlan, buffer_addrs: list[int]) -> Placement:
        regions: list[Region] = []
        if plan.state is not None:
            start = 0
            for buffer, width in plan.page_regions():
                stride = plan.bytes_per_block if plan.layout == "packed" else width
                regions.append((start, buffer_addrs[buffer], stride, width))
                start += width
        return Placement(
            {layer: (buffer_addrs[t.buffer] + t.offset, t.block_stride) for t in plan.tensors for layer in t.layers},
            tuple(regions),
        )

    def tiles(self, block_bytes: int, num_blocks: int, max_regions: int) -> bool:
        """Whether `regions` (at most `max_regions`) cover [0, block_bytes) in order without gaps, and every
        address of `num_blocks` blocks stays below 2**64 (a peer's claim, checked once at its handshake)."""
        if not self.regions or len(self.regions) > max_regions:
            return False
        end = 0
        for start, base, stride, width in self.regions:
            if start != end or width <= 0 or stride < width or base + num_blocks * stride >= 1 << 64:
                return False
            end += width
        return end == block_bytes

    def fits(self, num_blocks: int) -> bool:
        """Whether every layer's pages of `num_blocks` blocks have addresses below 2**64 (a peer's claim)."""
        return all(base + num_blocks * stride < 1 << 64 for base, stride in self.layers.values())

    def address(self, block: int, offset: int) -> tuple[int, int]:
        """(address of byte `offset` of block `block`, bytes of its region left from there)."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            raise ValueError(f"byte {offset} of a block lies in no region")
        start, base, stride, width = self.regions[i]
        if offset >= start + width:
            raise ValueError(f"byte {offset} of a block lies in no region")
        return base + block * stride + offset - start, start + width - offset

    @cached_property
    def _starts(self) -> list[int]:
        return [r[0] for r in self.regions]

    def to_json(self) -> dict[str, list[int]]:
        return {str(layer): list(v) for layer, v in self.layers.items()}

    @staticmethod
    def from_json(data: Mapping[str, list[int]]) -> Placement:
        return Placement({int(layer): (int(v[0]), int(v[1])) for layer, v in data.items()})


@dataclass(frozen=True)
class Descriptors:
    local: np.ndarray  # [n, 3] uint64: (address, length, device id)
    remote: np.ndarray

    @property
    def count(self) -> int:
        return len(self.local)

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0


def pair_descriptors(
    plan: KVPlan,
    local: Placement,
    remote: Placement,
    moves: Iterable[tuple[int, int, int]],
    local_device: int = 0,
    remote_device: int = 0,
) -> Descriptors:
    """`moves`: (group id, local block id, remote block id); for the state group, one page of a bundle on each
    side (the reader expands bundles). Pages pair in group layer order; adjacent pairs merge while both sides
    are contiguous."""
    runs: list[list[int]] = []  # [local address, remote address, length]

    def add(la: int, ra: int, length: int) -> None:
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == la and last[1] + last[2] == ra:
            last[2] += length
        else:
            runs.append([la, ra, length])

    for group_id, local_block, remote_block in moves:
        group = plan.groups[group_id]
        if group.is_state:  # one page: the block's S bytes, cut where either side's regions are cut
            offset = 0
            while offset < plan.bytes_per_block:
                la, local_left = local.address(local_block, offset)
                ra, remote_left = remote.address(remote_block, offset)
                length = min(local_left, remote_left)
                add(la, ra, length)
                offset += length
            continue
        for layer, page in zip(group.layers, group.pages, strict=True):
            (lbase, lstride), (rbase, rstride) = local.layers[layer], remote.layers[layer]
            add(lbase + local_block * lstride, rbase + remote_block * rstride, page)
    arr = np.array(runs, dtype=np.uint64).reshape(-1, 3)
    local_descs = np.stack([arr[:, 0], arr[:, 2], np.full(len(arr), local_device, dtype=np.uint64)], axis=1)
    remote_descs = np.stack([arr[:, 1], arr[:, 2], np.full(len(arr), remote_device, dtype=np.uint64)], axis=1)
    return Descriptors(local_descs, remote_descs)


def block_moves(
    local_tables: list[list[int]], remote_tables: list[list[int]], first_token: int, end_token: int, block_size: int
) -> list[tuple[int, int, int]]:
    """(group, local block, remote block) for the blocks holding tokens [first_token, end_token): entries the local
    table keeps (not the null block 0). A needed entry the remote side no longer holds is an error."""
    if end_token <= first_token:
        return []
    moves = []
    for g, (mine, theirs) in enumerate(zip(local_tables, remote_tables, strict=True)):
        for i in range(first_token // block_size, (end_token - 1) // block_size + 1):
            if i >= len(mine) or mine[i] == 0:
                continue
            if i >= len(theirs) or theirs[i] == 0:
                raise ValueError(f"the peer no longer holds block {i} of group {g}")
            moves.append((g, mine[i], theirs[i]))
    return moves
