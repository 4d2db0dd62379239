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


@pytest.mark.parametrize("bound", [None, 1])
@pytest.mark.parametrize("seed", range(5))
def test_random_bundles_and_blocks_keep_the_free_count_exact(seed, bound):
    """Bundles of 3 and single blocks, cached or not, freed, revived and evicted at random in a small pool:
    after every operation the invariants hold and used + free blocks account for the whole pool (also with at
    most one idle checkpoint: the bound's evictions keep the count exact)."""
    rng = random.Random(seed)
    pool = BlockPool(24, max_idle_checkpoints=bound)
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
            pool.cache_block(block, key(next_key), 1 if block.pages else 0, tokens=16 * rng.randrange(1, 9))
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


def _idle_checkpoints(pool: BlockPool, depths: list[int], first_key: int = 0) -> list:
    """Bundles of 2 cached as checkpoints after `depths` tokens, freed in that order (oldest first)."""
    heads = [pool.get_new_bundle(2) for _ in depths]
    for i, (head, tokens) in enumerate(zip(heads, depths, strict=True)):
        assert pool.cache_block(head, key(first_key + i), 1, tokens=tokens)
    for head in heads:
        pool.free_blocks([head])
    return heads


def test_past_the_bound_the_checkpoint_saving_the_least_compute_per_byte_goes():
    """Score = recency rank in [0, 1] + tokens / deepest (Marconi's rule; bundles are equal in bytes)."""
    pool = BlockPool(20, max_idle_checkpoints=2)
    deep, shallow, mid = _idle_checkpoints(pool, [48, 16, 32])
    # scores at the third free: deep 0 + 1, shallow 0.5 + 1/3, mid 1 + 2/3: the shallow one goes, not the oldest
    assert set(pool.idle_checkpoints) == {deep.block_id, mid.block_id} and pool.checkpoints_dropped == 1
    assert shallow.key is None and shallow.pages is None and (key(1), 1) not in pool.cached
    assert pool.num_free_blocks == 19  # the dropped bundle's blocks are free (uncached) ones now
    pool.check_integrity()
    # A hit on the deep one revives it; freed again it is the newest: now `mid` (old, shallower) goes.
    pool.touch([deep])
    later = _idle_checkpoints(pool, [40], first_key=10)[0]
    pool.free_blocks([deep])
    assert set(pool.idle_checkpoints) == {later.block_id, deep.block_id} and pool.checkpoints_dropped == 2
    pool.check_integrity()


def test_equal_depths_drop_the_least_recent_and_a_refresh_counts_as_use():
    pool = BlockPool(20, max_idle_checkpoints=2)
    a, _ = _idle_checkpoints(pool, [32, 32])
    pool.refresh([a])  # a hit's path: `a` is now the most recent
    c = _idle_checkpoints(pool, [32], first_key=10)[0]
    assert set(pool.idle_checkpoints) == {a.block_id, c.block_id}
    zero = BlockPool(20, max_idle_checkpoints=0)  # no idle checkpoint is kept at all
    _idle_checkpoints(zero, [16, 32])
    assert not zero.idle_checkpoints and not zero.cached and zero.num_free_blocks == 19
    zero.check_integrity()
    with pytest.raises(ValueError, match="max_idle_checkpoints"):
        BlockPool(4, max_idle_checkpoints=-1)
