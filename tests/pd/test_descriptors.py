"""Transfer descriptors and compatibility, from plans alone: no NIXL, no processes."""

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from hybridkv.connectors.identity import compat_hash
from hybridkv.connectors.pd.descriptors import Placement, block_moves, pair_descriptors
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

# Gemma-4-E2B-like: 3 groups of 3-6 owner layers, KV-sharing consumers, two head sizes.
CONFIG = json.loads((Path(__file__).parents[2] / "examples/configs/gemma4-e2b-like.json").read_text())


def plan(layout: str, block_size: int = 16, dtype: str = "float32"):
    cache = CacheConfig(memory_bytes=64 << 20, max_model_len=1024, kv_layout=layout)
    return plan_from_hf_config(CONFIG, cache, block_size=block_size, dtype=dtype)


def placement(p, base: int) -> Placement:
    return Placement.of(p, [base + (i << 32) for i in range(len(p.buffer_sizes))])


def owner_bytes(p, group: int) -> int:
    return sum(p.groups[group].pages)


def pages(p, where: Placement, moves, side: int) -> dict[int, tuple[int, int, int]]:
    """Start address -> (layer, block, length) of every page the moves name on one side (side 1: the local block
    of each move, 2: the remote one). Every such page must have an address range of its own there."""
    out: dict[int, tuple[int, int, int]] = {}
    for move in moves:
        group, block = p.groups[move[0]], move[side]
        for layer, length in zip(group.layers, group.pages, strict=True):
            base, stride = where.layers[layer]
            out[base + block * stride] = (layer, block, length)
    spans = sorted((a, a + n) for a, (_, _, n) in out.items())
    assert len(out) == sum(len(p.groups[m[0]].layers) for m in moves)
    assert all(end <= nxt for (_, end), (nxt, _) in pairwise(spans)), "pages overlap: the test proves nothing"
    return out


def split(descriptor, side_pages: dict[int, tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The (layer, block) pages one descriptor (address, length, device) covers, in address order."""
    at, end, out = int(descriptor[0]), int(descriptor[0]) + int(descriptor[1]), []
    while at < end:
        assert at in side_pages, f"descriptor {descriptor} reaches {at:#x}: no page the moves name starts there"
        layer, block, length = side_pages[at]
        out.append((layer, block))
        at += length
    assert at == end, f"descriptor {descriptor} ends inside the page of layer {layer}"
    return out


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [("packed", "packed"), ("per-layer", "per-layer"), ("packed", "per-layer"), ("per-layer", "packed")],
)
def test_every_owner_page_moves_once_and_pairs_with_the_same_layer(mine, theirs):
    """Rebuild, from each descriptor, which (layer, block) pages it covers locally and remotely: the same layers,
    in the same order, each local block with the remote block its move names, every owner page exactly once."""
    local, remote = plan(mine), plan(theirs)
    here, there = placement(local, 1 << 40), placement(remote, 1 << 44)
    moves = []
    for g in local.groups:  # two consecutive blocks on both sides (they may merge), and one apart
        gid = g.group_id
        moves += [(gid, 5 + 3 * gid, 9 + 2 * gid), (gid, 6 + 3 * gid, 10 + 2 * gid), (gid, 20 + gid, 40 + 3 * gid)]
    d = pair_descriptors(local, here, there, moves)
    assert d.nbytes == sum(owner_bytes(local, g) for g, _, _ in moves)
    assert np.array_equal(d.local[:, 1], d.remote[:, 1])
    mine_pages, their_pages = pages(local, here, moves, 1), pages(remote, there, moves, 2)
    covered = []
    for ld, rd in zip(d.local, d.remote, strict=True):
        lp, rp = split(ld, mine_pages), split(rd, their_pages)
        assert [layer for layer, _ in lp] == [layer for layer, _ in rp], (ld, rd)  # page i pairs with page i
        covered += [(layer, lb, rb) for (layer, lb), (_, rb) in zip(lp, rp, strict=True)]
    expected = [(layer, lb, rb) for g, lb, rb in moves for layer in local.groups[g].layers]
    assert sorted(covered) == sorted(expected)  # each (layer, local block, remote block) exactly once


def test_packed_moves_one_descriptor_per_block_and_merges_consecutive_blocks():
    p = plan("packed")
    here, there = placement(p, 1 << 40), placement(p, 1 << 44)
    scattered = [(0, 3, 7), (0, 9, 2)]
    assert pair_descriptors(p, here, there, scattered).count == 2
    consecutive = [(0, 3, 7), (0, 4, 8), (0, 5, 9)]
    assert pair_descriptors(p, here, there, consecutive).count == 1  # one run on both sides


def test_per_layer_moves_one_descriptor_per_region_and_mixed_layouts_pair_pages():
    packed, per_layer = plan("packed"), plan("per-layer")
    g = max(packed.groups, key=lambda g: len(g.layers))
    same = pair_descriptors(
        per_layer, placement(per_layer, 1 << 40), placement(per_layer, 1 << 44), [(g.group_id, 3, 7)]
    )
    assert same.count == per_layer.descriptors_per_block(g.group_id)
    mixed = pair_descriptors(packed, placement(packed, 1 << 40), placement(per_layer, 1 << 44), [(g.group_id, 3, 7)])
    # Mixed: pages merge only where both sides are contiguous, i.e. along the per-layer side's regions.
    assert mixed.count == per_layer.descriptors_per_block(g.group_id) > packed.descriptors_per_block(g.group_id)


def test_block_moves_skip_local_nulls_and_the_prefix_already_held():
    local = [[11, 12, 13, 14], [0, 0, 23, 24]]  # group 1 slides: entries 0-1 left the window
    remote = [[51, 52, 53, 54], [61, 62, 63, 64]]
    moves = block_moves(local, remote, first_token=16, end_token=63, block_size=16)
    assert moves == [(0, 12, 52), (0, 13, 53), (0, 14, 54), (1, 23, 63), (1, 24, 64)]
    assert block_moves(local, remote, 40, 40, 16) == []
    with pytest.raises(ValueError, match="no longer holds block 2 of group 1"):
        block_moves(local, [[51, 52, 53, 54], [61, 62, 0, 64]], 16, 63, 16)


def test_compat_hash_ignores_layout_but_not_model_dtype_or_block_size():
    base = compat_hash(plan("packed"), "model-a", "float32")
    assert compat_hash(plan("per-layer"), "model-a", "float32") == base
    assert compat_hash(plan("packed"), "model-b", "float32") != base
    assert compat_hash(plan("packed", dtype="bfloat16"), "model-a", "bfloat16") != base
    assert compat_hash(plan("packed", block_size=32), "model-a", "float32") != base


def test_placement_round_trips_through_json():
    p = placement(plan("per-layer"), 1 << 40)
    assert Placement.from_json(json.loads(json.dumps(p.to_json()))) == p


def hybrid_plan(layout: str, name: str = "nemotron-h-8b", **config):
    """Nemotron-H-8B: one region per block either way; Qwen3.5-0.8B per-layer: three regions per block."""
    hf = json.loads((Path(__file__).parents[2] / f"examples/configs/{name}.json").read_text())
    cache = CacheConfig(memory_bytes=256 << 20, max_model_len=1024, kv_layout=layout)
    return plan_from_hf_config(hf | config, cache, dtype="bfloat16")


def test_compat_hash_names_the_scan_chunk_and_the_state_dtype_not_the_layout():
    base = compat_hash(hybrid_plan("packed"), "m", "bfloat16")
    assert compat_hash(hybrid_plan("per-layer"), "m", "bfloat16") == base
    assert compat_hash(hybrid_plan("packed", chunk_size=64), "m", "bfloat16") != base
    assert compat_hash(hybrid_plan("packed", mamba_ssm_cache_dtype="float32"), "m", "bfloat16") != base


@pytest.mark.parametrize(("mine", "theirs"), [("packed", "packed"), ("packed", "per-layer"), ("per-layer", "packed")])
def test_a_state_page_pairs_byte_for_byte_across_layouts(mine, theirs):
    local_plan, remote_plan = hybrid_plan(mine, "qwen3.5-0.8b"), hybrid_plan(theirs, "qwen3.5-0.8b")
    here, there = placement(local_plan, 1 << 40), placement(remote_plan, 1 << 44)
    s = local_plan.bytes_per_block
    assert here.tiles(s, local_plan.num_blocks, 8) and there.tiles(s, remote_plan.num_blocks, 8)
    state_group = local_plan.state.group
    d = pair_descriptors(local_plan, here, there, [(state_group, 3, 7)])
    assert d.nbytes == s
    if mine == theirs == "packed":
        assert d.count == 1  # one descriptor per state page
    k = 0  # descriptors come in byte order: byte k of local block 3 pairs with byte k of remote block 7
    for la, ra, n in zip(d.local[:, 0].tolist(), d.remote[:, 0].tolist(), d.local[:, 1].tolist()):
        assert (here.address(3, k)[0], there.address(7, k)[0]) == (la, ra) and n > 0
        k += n
    assert k == s


def test_state_regions_that_do_not_tile_a_block_are_refused():
    plan = hybrid_plan("per-layer", "qwen3.5-0.8b")
    p, s, n = placement(plan, 1 << 40), plan.bytes_per_block, plan.num_blocks
    assert p.tiles(s, n, 8) and len(p.regions) > 1
    start, base, stride, width = p.regions[0]
    rest = p.regions[1:]
    assert not Placement(p.layers, ((start, base, stride, width - 1), *rest)).tiles(s, n, 8)  # a gap
    assert not Placement(p.layers, p.regions + p.regions[-1:]).tiles(s, n, 8)  # past the block
    assert not Placement(p.layers, ((start, base, width - 1, width), *rest)).tiles(s, n, 8)  # blocks overlap
    assert not Placement(p.layers, ()).tiles(s, n, 8)
    assert not p.tiles(s, n, len(p.regions) - 1)  # more regions than a block of this plan can have
    huge = (start, (1 << 64) - 1 - width, (1 << 64) - 1 - width, width)  # addresses past 2**64 at block 1
    assert not Placement(p.layers, (huge, *rest)).tiles(s, n, 8)
    assert p.fits(n) and not Placement({0: ((1 << 64) - 8, 8)}).fits(n)


def hand_state_address(p, base: int, block: int, k: int) -> int:
    """Byte k of state page `block`, from the plan's numbers alone: packed, one buffer of S-byte blocks; per-layer,
    buffer i holds its slice of every block (buffer_sizes[i] / num_blocks bytes each), slices in buffer order."""
    if p.layout == "packed":
        return base + block * p.bytes_per_block + k
    start = 0
    for i, size in enumerate(p.buffer_sizes):
        width = size // p.num_blocks
        if k < start + width:
            return base + (i << 32) + block * width + k - start
        start += width
    raise AssertionError(f"byte {k} past the block")


@pytest.mark.parametrize(
    ("mine", "theirs"), [("per-layer", "per-layer"), ("packed", "per-layer"), ("per-layer", "packed")]
)
def test_state_page_descriptors_address_each_buffer_by_hand(mine, theirs):
    """Qwen3.5-0.8B per-layer keeps a state page in three buffers of 32 KiB slices: every descriptor byte must be
    where `hand_state_address` (plan numbers, not Placement) puts it, so a region based at another buffer fails."""
    local_plan, remote_plan = hybrid_plan(mine, "qwen3.5-0.8b"), hybrid_plan(theirs, "qwen3.5-0.8b")
    assert len(hybrid_plan("per-layer", "qwen3.5-0.8b").buffer_sizes) == 3
    here, there = placement(local_plan, 1 << 40), placement(remote_plan, 1 << 44)
    s = local_plan.bytes_per_block
    cuts = sorted({0, s} | {c for p in (local_plan, remote_plan) for c in range(0, s, s // len(p.buffer_sizes))})
    d = pair_descriptors(local_plan, here, there, [(local_plan.state.group, 3, 7)])
    k = 0
    for la, ra, n in zip(d.local[:, 0].tolist(), d.remote[:, 0].tolist(), d.local[:, 1].tolist(), strict=True):
        for c in [k, *(c for c in cuts if k < c < k + n)]:  # the start and every place a buffer may change
            want = hand_state_address(local_plan, 1 << 40, 3, c), hand_state_address(remote_plan, 1 << 44, 7, c)
            assert (la + c - k, ra + c - k) == want, (mine, theirs, c)
        k += n
    assert k == s
