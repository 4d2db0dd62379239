"""BlockPool bundles: a recurrent-state entry is m block ids that are allocated, cached, revived and evicted as
one, while the pool's free count stays exact (a cached bundle's tails count as free; evicting it frees them)."""

import random

import pytest

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.hashing import BlockHash


def key(i: int) -> BlockHash:
    return i.to_bytes(32, "little")


def test_a_bundle_is_m_blocks_held_through_its_head():
    pool = BlockPool(10)
    head = pool.get_new_bundle(3)
    assert head.pages == (1, 2, 3) and head.block_id == 1 and pool.pages(1) == (1, 2, 3) and pool.pages(4) == (4,)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 3
    assert [pool.blocks[b].ref_cnt for b in head.pages] == [1, 1, 1]
    pool.free_blocks([head])  # uncached: the bundle is kept whole as a spare, its pages counted free
    assert head.pages == (1, 2, 3) and pool.num_free_blocks == 9 and pool.spares == [head]
    pool.check_integrity()


def test_a_spare_bundle_is_taken_whole_and_dissolved_only_before_a_cached_block_would_go():
    pool = BlockPool(10)
    first = pool.get_new_bundle(3)
    pool.drain_new_bundles()
    pool.free_blocks([first])
    again = pool.get_new_bundle(3)  # the decode that crossed a block end: one entry freed, one taken, O(1)
    assert again is first and again.pages == (1, 2, 3) and not pool.spares
    assert pool.drain_new_bundles() == {1: (1, 2, 3)}  # reported again: the runner's table stays right
    assert [pool.blocks[b].ref_cnt for b in again.pages] == [1, 1, 1]
    cached = pool.get_new_blocks(6)  # blocks 4..9, all published and freed: the queue holds cached blocks only
    for i, block in enumerate(cached):
        assert pool.cache_block(block, key(i), 0)
    pool.free_blocks(cached)
    pool.free_blocks([again])
    single = pool.get_new_blocks(1)  # the front would evict a cached block: the spare dissolves first
    assert single[0] is first and first.pages is None and not pool.spares
    assert len(pool.cached) == 6 and pool.num_free_blocks == 8
    pool.check_integrity()
    spare = pool.get_new_bundle(2)  # blocks 2 and 3, the dissolved spare's tails at the front
    assert spare.pages == (2, 3)
    pool.free_blocks([spare, single[0]])
    assert pool.get_new_blocks(1) == single and pool.spares == [spare]  # an uncached front block goes first
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_random_bundles_and_blocks_keep_the_free_count_exact(seed):
    """Bundles of 3 and single blocks, cached or not, freed, revived and evicted at random in a small pool:
    after every operation the invariants hold and used + free blocks account for the whole pool."""
    rng = random.Random(seed)
    pool = BlockPool(24)
    held: list = []
    next_key = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks >= 3:
            held.append(pool.get_new_bundle(3))
        elif op < 0.5 and pool.num_free_blocks >= 1:
            held.extend(pool.get_new_blocks(1))
        elif op < 0.65 and held:
            block = rng.choice(held)
            next_key += 1
            pool.cache_block(block, key(next_key), 1 if block.pages else 0)
        elif op < 0.85 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.free_blocks([block])
        elif pool.cached:
            cached = rng.choice(list(pool.cached.values()))  # a prefix hit takes one more reference
            pool.touch([cached])
            held.append(cached)
        pool.check_integrity()
        distinct = {id(b): b for b in held}.values()  # a revived block held twice counts once
        assert pool.num_used_blocks == sum(len(b.pages or (b,)) for b in distinct)
        assert pool.num_used_blocks + pool.num_free_blocks == 23
    for block in held:
        pool.free_blocks([block])
    pool.check_integrity()
    assert pool.num_free_blocks == 23
