"""BlockCopier.from_rows, the loader's batched copy: runs of blocks merge into strided copies, and any pattern of
blocks and rows (consecutive, strided, fragmented, descending) lands exactly where one copy per block puts it."""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv.connectors.offload.copier import BlockCopier, Span, runs

NUM_BLOCKS, SLOT = 64, 96


def copier(spans: tuple[Span, ...]) -> BlockCopier:
    c = BlockCopier.__new__(BlockCopier)  # no plan: the spans of one group, as a plan would give them
    c.buffers = [torch.zeros(NUM_BLOCKS * 64 + 16, dtype=torch.uint8), torch.zeros(NUM_BLOCKS * 48, dtype=torch.uint8)]
    c.non_blocking = False
    c.spans = [spans]
    return c


SPANS = {
    "packed": (Span(0, 0, 64, 64, 0),),  # one span filling its stride
    "per-layer": (Span(0, 16, 64, 24, 0), Span(1, 8, 48, 40, 24), Span(0, 40, 64, 8, 64)),  # gaps between blocks
}


def test_runs_split_where_either_step_changes():
    assert runs([5, 6, 7, 9, 11, 2], [0, 3, 6, 7, 8, 1]) == [(0, 3, 1, 3), (3, 2, 2, 1), (5, 1, 1, 1)]
    assert runs([], []) == [] and runs([4], [2]) == [(0, 1, 1, 1)]
    assert runs([3, 2, 1], [0, 1, 2]) == [(0, 1, 1, 1), (1, 1, 1, 1), (2, 1, 1, 1)]  # no negative strides


@pytest.mark.parametrize("layout", SPANS)
@pytest.mark.parametrize("pattern", ["consecutive", "strided", "fragmented"])
def test_from_rows_matches_one_copy_per_block(layout, pattern):
    rng = random.Random(f"{layout}-{pattern}")
    n = 24
    if pattern == "consecutive":
        blocks, rows = list(range(10, 10 + n)), list(range(3, 3 + n))
    elif pattern == "strided":
        blocks, rows = list(range(1, 1 + 2 * n, 2)), list(range(0, 3 * n, 3))
    else:
        blocks, rows = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(3 * n), n)
    src = torch.randint(0, 256, (3 * n, SLOT), dtype=torch.uint8)
    fast, slow = copier(SPANS[layout]), copier(SPANS[layout])
    for b in fast.buffers:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))  # bytes outside the blocks must survive
    slow.buffers = [b.clone() for b in fast.buffers]
    copies = fast.from_rows(0, blocks, rows, src)
    for b, r in zip(blocks, rows):
        slow.from_slot(0, b, src[r])
    for got, want in zip(fast.buffers, slow.buffers):
        assert torch.equal(got, want)
    spans = len(SPANS[layout])
    assert copies == spans * len(runs(blocks, rows))
    if pattern != "fragmented":
        assert copies == spans  # one run: one copy per span for the whole load
