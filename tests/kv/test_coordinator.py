import random

import pytest

from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.hashing import hash_blocks
from tests.kv.util import P, model, plan


def coordinator(pattern: str = "FS", blocks: int = 64, caching: bool = True, max_len: int = 32) -> KVCacheCoordinator:
    """A pool of exactly `blocks` blocks. Window 32, block 16: resuming needs the last 2 blocks, a decoding
    request holds at most 3 per sliding group."""
    stride = plan(model(pattern), len(pattern) * P * 100).bytes_per_block
    p = plan(model(pattern), stride * blocks, max_model_len=max_len, max_num_batched_tokens=16)
    assert p.num_blocks == blocks
    return KVCacheCoordinator(p, enable_prefix_caching=caching)


def prompt(seed: int, n: int) -> list[int]:
    return [random.Random(seed).randrange(1000) for _ in range(n)]


def finish_and_check(c: KVCacheCoordinator, *req_ids: str) -> None:
    for r in req_ids:
        c.free(r)
    c.check_integrity()
    assert c.pool.num_used_blocks == 0


def test_sliding_window_frees_blocks_that_left_the_window():
    c = coordinator()
    assert c.allocate("a", 80, num_computed_tokens=0)
    full, window = c.block_ids("a")
    assert len(full) == len(window) == 5 and 0 not in window
    used = c.pool.num_used_blocks
    # After 80 computed tokens the next token reads [49, 80): blocks 0-2 (tokens 0-47) are dropped.
    assert c.allocate("a", 81, num_computed_tokens=80)
    full, window = c.block_ids("a")
    assert window[:3] == [0, 0, 0] and 0 not in window[3:] and len(window) == 6 and len(full) == 6
    assert c.pool.num_used_blocks == used - 3 + 2  # one new block per group
    c.check_integrity()
    finish_and_check(c, "a")


def test_tokens_loaded_from_elsewhere_take_no_sliding_blocks_outside_the_window():
    """A connector loads tokens [0, 79) and token 79 is computed next: the sliding group needs only the blocks
    that token reads (tokens 48-79), the full group every block. The budget check counts the same."""
    c = coordinator(blocks=9)  # 8 usable: 5 full + 2 sliding fit, 5 + 5 would not
    assert c.allocate("a", 80, num_computed_tokens=79)
    full, window = c.block_ids("a")
    assert 0 not in full and window[:3] == [0, 0, 0] and 0 not in window[3:] and len(window) == 5
    assert c.pool.num_used_blocks == 5 + 2
    assert not c.allocate("b", 80, num_computed_tokens=79)  # all or nothing: 7 more do not fit
    c.check_integrity()
    finish_and_check(c, "a")


def test_prefix_hit_across_requests():
    c = coordinator()
    tokens = prompt(1, 70)
    hashes = hash_blocks(tokens, 16)
    assert c.find_cached_prefix(hashes, 70).num_tokens == 0
    assert c.allocate("a", 70, 0)
    c.cache_blocks("a", hashes, 70)
    a_tables = c.block_ids("a")
    c.free("a")
    hit = c.find_cached_prefix(hashes, 70)
    assert hit.num_tokens == 64  # 4 full blocks; the last 6 tokens are recomputed
    assert c.allocate("b", 70, hit.num_tokens, hit)
    full, window = c.block_ids("b")
    assert full[:4] == a_tables[0][:4]
    assert window[:2] == [0, 0] and window[2:4] == a_tables[1][2:4]  # only the window's blocks are reused
    finish_and_check(c, "b")


def test_a_whole_prompt_hit_still_computes_the_last_token():
    c = coordinator()
    tokens = prompt(2, 64)
    hashes = hash_blocks(tokens, 16)
    assert c.allocate("a", 64, 0)
    c.cache_blocks("a", hashes, 64)
    assert c.find_cached_prefix(hashes, 64).num_tokens == 48
    finish_and_check(c, "a")


def test_sliding_hit_search_goes_right_to_left_and_the_groups_agree():
    c = coordinator()
    hashes = hash_blocks(prompt(3, 96), 16)  # 6 blocks
    window_mgr = c.managers[1]
    assert c.allocate("a", 96, 0)
    c.cache_blocks("a", hashes, 96)
    c.free("a")
    # Evict block 2 of the full group and block 5 of the sliding group: the full group now hits [0, 2)
    # and the sliding group alone would hit [3, 5) (resume at block 5 with 2 window blocks before it).
    for gid, idx in ((0, 2), (1, 5)):
        block = c.pool.get_cached_block(hashes[idx], gid)
        c.pool.free_queue.remove(block)
        c.pool.free_queue.appendleft(block)
    c.pool.get_new_blocks(2)  # evicts exactly those two
    window_alone = window_mgr.find_longest_hit(hashes, 5)
    assert len(window_alone) == 5 and window_alone[:3] == [c.pool.null_block] * 3
    hit = c.find_cached_prefix(hashes, 97)
    assert hit.num_tokens == 32  # both groups accept 2 blocks: the sliding run [0, 2) starts at block 0
    assert [len(b) for b in hit.blocks] == [2, 2] and c.pool.null_block not in hit.blocks[1]


def test_allocation_is_all_or_nothing():
    c = coordinator(blocks=8)  # 7 usable blocks
    assert c.allocate("a", 48, 0)  # 3 + 3 blocks
    free_before = c.num_free_blocks
    assert not c.allocate("b", 32, 0)  # needs 2 + 2
    assert c.num_free_blocks == free_before and c.block_ids("b") == [[], []]
    c.check_integrity()
    finish_and_check(c, "a")


def test_a_hit_on_free_blocks_counts_them_against_the_budget():
    c = coordinator(blocks=9)  # 8 usable
    tokens = prompt(4, 64)
    hashes = hash_blocks(tokens, 16)
    assert c.allocate("a", 64, 0)
    c.cache_blocks("a", hashes, 64)
    c.free("a")
    hit = c.find_cached_prefix(hashes, 65)
    assert hit.num_tokens == 64
    # Reviving 4 + 2 cached blocks and adding 1 + 1 new ones needs 8: exactly what is free.
    assert c.allocate("b", 65, hit.num_tokens, hit)
    assert c.num_free_blocks == 0
    finish_and_check(c, "b")


def test_caching_off_never_hits():
    c = coordinator(caching=False)
    hashes = hash_blocks(prompt(5, 64), 16)
    assert c.allocate("a", 64, 0)
    c.cache_blocks("a", hashes, 64)
    assert c.find_cached_prefix(hashes, 64).num_tokens == 0
    finish_and_check(c, "a")


@pytest.mark.parametrize("pattern", ["FS", "FFSSSS", "SS", "F"])
def test_random_workload_keeps_every_invariant(pattern):
    """Requests arrive with shared prefixes, prefill in chunks, decode, get preempted or finish; after every
    operation each block is either free or held by exactly the tables that list it."""
    rng = random.Random(0)
    c = coordinator(pattern, blocks=40)
    prefixes = [prompt(s, 40) for s in range(3)]
    live: dict[str, dict] = {}
    for step in range(400):
        if len(live) < 4 and rng.random() < 0.3:
            rid = f"r{step}"
            tokens = rng.choice(prefixes)[: rng.randrange(1, 40)] + prompt(step, rng.randrange(1, 40))
            hashes = hash_blocks(tokens, 16)
            hit = c.find_cached_prefix(hashes, len(tokens))
            if c.allocate(rid, hit.num_tokens + 1, hit.num_tokens, hit):
                live[rid] = {"tokens": tokens, "hashes": hashes, "done": hit.num_tokens + 1}
        for rid, r in list(live.items()):
            target = min(r["done"] + rng.randrange(1, 20), len(r["tokens"]) + 30)
            if rng.random() < 0.05 or not c.allocate(rid, target, r["done"]):
                c.free(rid)  # finished, aborted or preempted
                del live[rid]
                continue
            r["tokens"] += prompt(step, max(0, target - len(r["tokens"])))
            r["hashes"] = hash_blocks(r["tokens"], 16)
            c.cache_blocks(rid, r["hashes"], target)
            r["done"] = target
        c.check_integrity()
    finish_and_check(c, *live)
