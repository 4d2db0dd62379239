import pytest

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.hashing import hash_block


def h(i: int) -> bytes:
    return hash_block(None, [i])


def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    pool.check_integrity()


def test_too_small_pool_is_an_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_lru_eviction_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(5)  # ids 1..5
    for i, b in enumerate(a[:3]):
        pool.cache_block(b, h(i), group_id=0)
    # Freed cached blocks go to the tail in order (1, 2, 3); uncached ones to the head (5 first then 4).
    pool.free_blocks(a[:3])
    pool.free_blocks([a[3], a[4]])
    assert [b.block_id for b in pool.free_queue] == [5, 4, 1, 2, 3]
    # Uncached blocks are reused first, then the least recently freed cached block, whose hash is evicted.
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [5, 4, 1]
    assert pool.get_cached_block(h(0), 0) is None
    assert pool.get_cached_block(h(1), 0).block_id == 2
    pool.check_integrity()


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(7), group_id=1)
    pool.free_blocks([b])
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(h(7), 1)
    assert hit is b and pool.get_cached_block(h(7), 0) is None
    pool.touch([hit, hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([hit, hit])
    pool.check_integrity()


def test_a_taken_key_is_not_cached_twice():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1), 0)
    pool.cache_block(b, h(1), 0)
    assert pool.get_cached_block(h(1), 0) is a and b.key is None
    pool.free_blocks([a, b])
    pool.check_integrity()


def test_caching_can_be_disabled():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1), 0)
    assert pool.get_cached_block(h(1), 0) is None and not pool.cached


def test_check_integrity_catches_a_leak_and_a_double_free():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # a block nobody holds that is not in the free queue: leaked
    with pytest.raises(AssertionError, match="neither held nor free"):
        pool.check_integrity()
    a.ref_cnt = 1
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])


def test_reset_prefix_cache():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1), 0)
    assert pool.reset_prefix_cache() == 1 and a.key is None
    pool.free_blocks([a])
    pool.check_integrity()
