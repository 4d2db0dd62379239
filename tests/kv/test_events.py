"""KV events from the KV core: what the pool logs as blocks are cached, evicted and cleared, per group. Replaying
the log must give exactly the pool's cached set, and every stored record must be a true chain segment: its hashes
recompute from its parent and its tokens."""

import random

import torch

from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog
from hybridkv.kv.hashing import hash_block, hash_blocks
from hybridkv.kv.managers import log_stored
from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.state import RecurrentStateSpec
from tests.kv.util import BS, P, full, model, plan


def coordinator(pattern: str = "FS", blocks: int = 64, max_len: int = 256) -> KVCacheCoordinator:
    stride = plan(model(pattern), len(pattern) * P * 100).bytes_per_block
    p = plan(model(pattern), stride * blocks, max_model_len=max_len, max_num_batched_tokens=64)
    assert p.num_blocks == blocks
    return KVCacheCoordinator(p, events=KVEventLog())


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def replay(events: list[KVEvent], into: dict[int, set[bytes]] | None = None) -> dict[int, set[bytes]]:
    cached = into if into is not None else {}
    for e in events:
        if isinstance(e, BlockStored):
            cached.setdefault(e.group_id, set()).update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            cached.get(e.group_id, set()).difference_update(e.block_hashes)
        else:
            cached.clear()
    return {g: s for g, s in cached.items() if s}


def pool_set(c: KVCacheCoordinator) -> dict[int, set[bytes]]:
    return {g: set(hs) for g, hs in c.pool.cached_hashes().items()}


def check_chain(e: BlockStored) -> None:
    """The record's hashes follow from its parent and tokens, block by block."""
    assert len(e.token_ids) == len(e.block_hashes) * e.block_size, e
    parent = e.parent_block_hash
    for i, h in enumerate(e.block_hashes):
        parent = hash_block(parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
        assert parent == h, f"block {i} of a stored record does not follow from its parent and tokens"


def run(c: KVCacheCoordinator, rid: str, toks: list[int], computed: int, n: int) -> None:
    """Schedule and run n tokens after `computed`, then publish (the scheduler's order)."""
    assert c.allocate(rid, computed + n, computed)
    c.cache_blocks(rid, hash_blocks(toks, BS), computed + n, toks)


def test_stored_records_carry_the_chain_tokens_and_group():
    c = coordinator()
    toks = tokens(1, 80)
    hashes = hash_blocks(toks, BS)
    run(c, "a", toks, 0, 70)
    first = c.events.drain()
    assert [(e.group_id, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium) for e in first] == [
        (g, tuple(hashes[:4]), None, tuple(toks[:64]), BS, "GPU") for g in (0, 1)
    ]
    run(c, "a", toks, 70, 10)  # block 4 fills: its parent is block 3
    second = c.events.drain()
    assert [(e.group_id, e.block_hashes, e.parent_block_hash, e.token_ids) for e in second] == [
        (g, (hashes[4],), hashes[3], tuple(toks[64:80])) for g in (0, 1)
    ]
    for e in first + second:
        check_chain(e)
    assert replay(first + second) == pool_set(c)


def test_a_key_cached_by_another_block_is_not_stored_twice():
    c = coordinator()
    toks = tokens(2, 40)
    assert c.allocate("a", 40, 0) and c.allocate("b", 40, 0)  # both compute the same prompt, no hit yet
    c.cache_blocks("a", hash_blocks(toks, BS), 40, toks)
    c.cache_blocks("b", hash_blocks(toks, BS), 40, toks)
    events = c.events.drain()
    assert len(events) == 2 and all(len(e.block_hashes) == 2 for e in events)


def test_eviction_logs_removed_and_the_replay_matches_the_pool():
    c = coordinator(blocks=13, max_len=96)  # 12 usable: a 5-block request (x2 groups) leaves 2 free
    toks = tokens(3, 80)
    run(c, "a", toks, 0, 80)
    c.free("a")
    run(c, "b", tokens(4, 80), 0, 80)  # takes the 2 uncached blocks, then evicts 8 of a's
    events = c.events.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 8
    assert all(e.medium == "GPU" and e.group_id in (0, 1) for e in removed)
    assert replay(events) == pool_set(c)


def test_reset_logs_all_blocks_cleared():
    c = coordinator()
    run(c, "a", tokens(5, 48), 0, 48)
    c.free("a")
    assert c.pool.reset_prefix_cache() == 6
    events = c.events.drain()
    assert events[-1] == AllBlocksCleared() and replay(events) == {} == pool_set(c)


def test_no_log_no_records():
    c = coordinator()
    c.pool.events = None
    run(c, "a", tokens(6, 48), 0, 48)  # no token ids needed, nothing recorded anywhere
    assert c.events is None


def test_the_state_group_logs_one_record_per_checkpoint_whatever_its_pages():
    spec = RecurrentStateSpec(dtype=torch.float32, block_size=BS, mixer="gated_deltanet", conv_shape=(3, 64),
                              ssm_shape=(2, 16, 16), ssm_dtype=torch.float32, chunk_size=16)  # fmt: skip
    p = plan(ModelKV("test", (full(), spec, spec, spec), {}), P * 64, max_model_len=256, max_num_batched_tokens=128)
    c = KVCacheCoordinator(p, events=KVEventLog())
    toks = tokens(7, 64)
    hashes = hash_blocks(toks, BS)
    run(c, "a", toks, 0, 64)  # one chunk: the state after 64 tokens is the checkpoint of block 3
    events = c.events.drain()
    by_group = {e.group_id: e for e in events}
    assert by_group[0].block_hashes == tuple(hashes)
    g = p.state.group
    assert p.state.num_pages == 3 and len(events) == 2  # one record for group 0, one for the 3-page state entry
    assert by_group[g].block_hashes == (hashes[3],) and by_group[g].parent_block_hash == hashes[2]
    assert by_group[g].token_ids == tuple(toks[48:64])
    assert replay(events) == pool_set(c)


def test_random_traffic_replays_to_the_pool_and_every_record_is_a_chain():
    """Requests with shared prefixes, decode steps, frees and evictions in a small pool: after every step the
    records replayed so far give the pool's cached set."""
    rng = random.Random(0)
    c = coordinator(blocks=40)
    prefixes = [tokens(100 + i, 48) for i in range(3)]
    cached: dict[int, set[bytes]] = {}
    live: dict[str, tuple[list[int], int]] = {}
    stored = 0
    for step in range(200):
        if len(live) < 3 and rng.random() < 0.4:
            toks = rng.choice(prefixes)[: rng.randrange(16, 49)] + tokens(step, rng.randrange(1, 60))
            rid = f"r{step}"
            hit = c.find_cached_prefix(hash_blocks(toks, BS), len(toks))
            if c.allocate(rid, len(toks), hit.num_tokens, hit):
                c.cache_blocks(rid, hash_blocks(toks, BS), len(toks), toks)
                live[rid] = (toks, len(toks))
        for rid, (toks, n) in list(live.items()):
            toks.append(rng.randrange(1000))
            if n + 1 > 120 or rng.random() < 0.05 or not c.allocate(rid, n + 1, n):
                c.free(rid)
                del live[rid]
                continue
            c.cache_blocks(rid, hash_blocks(toks, BS), n + 1, toks)
            live[rid] = (toks, n + 1)
        events = c.events.drain()
        for e in events:
            if isinstance(e, BlockStored):
                check_chain(e)
                stored += 1
        cached = replay(events, cached)
        assert cached == pool_set(c), f"step {step}"
    assert stored > 50


def test_stored_runs_split_where_the_entered_blocks_have_a_gap():
    """Blocks 2 and 5 were cached already (by another request's blocks): the entered 0-1, 3-4 and 6 are three
    records, each with its own parent and tokens. One record for 0-6 would republish 2 and 5, keys this tier
    already had, and with them blocks this request did not store."""
    toks = tokens(8, 7 * BS)
    hashes = hash_blocks(toks, BS)
    log = KVEventLog()
    log_stored(log, [0, 1, 3, 4, 6], hashes, toks, BS, 1)
    got = [(e.block_hashes, e.parent_block_hash, e.token_ids, e.group_id) for e in log.drain()]
    assert got == [
        (tuple(hashes[0:2]), None, tuple(toks[0 : 2 * BS]), 1),
        (tuple(hashes[3:5]), hashes[2], tuple(toks[3 * BS : 5 * BS]), 1),
        (tuple(hashes[6:7]), hashes[5], tuple(toks[6 * BS : 7 * BS]), 1),
    ]
    log_stored(log, [2, 3, 4], hashes, toks, BS, 0)  # no gap: one record
    assert [e.block_hashes for e in log.drain()] == [tuple(hashes[2:5])]
