"""The state group through the coordinator: which entries a request holds (each a bundle of the state's pages),
what is published as a checkpoint, and which hits resume."""

import random

import pytest
import torch

from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.hashing import hash_blocks
from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.state import RecurrentStateSpec
from tests.kv.util import BS, P, full, plan


def state(bs: int = BS) -> RecurrentStateSpec:
    """768 B of conv and 2 KiB of recurrent state: 2,816 B per layer, so three layers take 3 pages of P."""
    return RecurrentStateSpec(dtype=torch.float32, block_size=bs, mixer="gated_deltanet", conv_shape=(3, 64),
                              ssm_shape=(2, 16, 16), ssm_dtype=torch.float32, chunk_size=16)  # fmt: skip


def coordinator(blocks: int = 64) -> KVCacheCoordinator:
    m = ModelKV("test", (full(), state(), state(), state()), {})
    p = plan(m, P * blocks, max_model_len=256, max_num_batched_tokens=128)
    assert p.num_blocks == blocks and p.bytes_per_block == P
    assert p.state.num_pages == 3 and p.state.group == 1 and len(p.groups) == 2
    return KVCacheCoordinator(p)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [random.Random(seed).randrange(1000) for _ in range(n)]


def state_tables(c: KVCacheCoordinator, rid: str) -> list[list[int]]:
    """The state group's table, and the same table per page (page j of each entry's bundle; 0 stays 0): the
    view the per-page groups of earlier versions had, so the table rules read the same for every page."""
    table = c.block_ids(rid)[1]
    for b in table:
        assert b == 0 or len(c.pages(b)) == 3, f"entry {b} is not a bundle of 3 pages"
    return [[c.pages(b)[j] if b else 0 for b in table] for j in range(3)]


def cached_state_entries(c: KVCacheCoordinator, hashes) -> list[set[int]]:
    """The entries published under the request's hashes (once per page, as the table view above)."""
    return [{e for e, h in enumerate(hashes) if c.pool.get_cached_block(h, 1) is not None}] * 3


def step(c: KVCacheCoordinator, rid: str, hashes, computed: int, n: int) -> None:
    """Schedule n tokens after `computed`, run them, publish: what the scheduler does per step."""
    assert c.allocate(rid, computed + n, computed)
    c.cache_blocks(rid, hashes, computed + n)
    c.check_integrity()


def test_prefill_then_decode_holds_the_live_entries_and_publishes_the_checkpoint():
    c = coordinator()
    hashes = hash_blocks(tokens(200), BS)
    assert c.allocate("a", 100, 0)
    for t in state_tables(c, "a"):  # a 100-token chunk takes one state, at its end: entry cdiv(100, 16) - 1
        assert t == [0] * 6 + [t[6]] and t[6] != 0
    c.cache_blocks("a", hashes, 100)
    assert cached_state_entries(c, hashes) == [set()] * 3  # entry 6 holds the state after 100 tokens, not 112
    c.check_integrity()
    live = [t[6] for t in state_tables(c, "a")]
    for computed in range(100, 111):  # decode 101 .. 111: in place, nothing published
        step(c, "a", hashes, computed, 1)
        assert [t[6] for t in state_tables(c, "a")] == live and len(state_tables(c, "a")[0]) == 7
        assert cached_state_entries(c, hashes) == [set()] * 3
    step(c, "a", hashes, 111, 1)  # 112 tokens computed: entry 6 is the state after exactly 7 blocks
    assert cached_state_entries(c, hashes) == [{6}] * 3
    assert c.allocate("a", 113, 112)  # crossing a block: a new live entry, the old one kept for the copy
    for t, old in zip(state_tables(c, "a"), live, strict=True):
        assert t[:6] == [0] * 6 and t[6] == old and t[7] not in (0, old)
    c.cache_blocks("a", hashes, 113)
    assert cached_state_entries(c, hashes) == [{6}] * 3
    c.check_integrity()
    assert c.allocate("a", 114, 113)  # one step later the old live entry goes (still cached)
    for t in state_tables(c, "a"):
        assert t[:7] == [0] * 7 and t[7] != 0
    head = c.pool.blocks[live[0]]  # the bundle's head (its lowest page) is what is referenced and cached
    assert head.ref_cnt == 0 and head.key is not None and head.pages == tuple(live)
    c.check_integrity()
    c.free("a")
    c.check_integrity()
    assert c.pool.num_used_blocks == 0


def test_a_long_chunk_takes_one_state_and_the_prediction_agrees():
    c = coordinator()
    hashes = hash_blocks(tokens(256), BS)
    hit = c.find_cached_prefix(hashes, 256)
    assert hit.num_tokens == 0
    need = sum(m.num_blocks_to_allocate("a", 200, h, 0) for m, h in zip(c.managers, hit.blocks, strict=True))
    free = c.pool.num_free_blocks
    assert c.allocate("a", 200, 0)
    assert need == free - c.pool.num_free_blocks == 13 + 3  # 13 attention blocks, one bundle of 3 pages
    assert all(sum(b != 0 for b in t) == 1 for t in state_tables(c, "a"))
    c.cache_blocks("a", hashes, 200)
    assert cached_state_entries(c, hashes) == [set()] * 3  # 200 is no block end
    # The next chunk crosses three block ends without ending on one: nothing is a checkpoint.
    c.remove_skipped_blocks("a", 200)
    need = sum(m.num_blocks_to_allocate("a", 250, (), 200) for m in c.managers)
    free = c.pool.num_free_blocks
    assert c.allocate("a", 250, 200)
    assert need == free - c.pool.num_free_blocks == 3 + 3
    c.cache_blocks("a", hashes, 250)
    assert cached_state_entries(c, hashes) == [set()] * 3  # entry 12 holds the state after 200, not 208
    for t in state_tables(c, "a"):
        assert [e for e, b in enumerate(t) if b] == [12, 15]
    c.check_integrity()
    c.free("a")
    c.check_integrity()


def checkpoint_at_112(c: KVCacheCoordinator, hashes) -> None:
    assert c.allocate("a", 112, 0)
    c.cache_blocks("a", hashes, 112)
    assert cached_state_entries(c, hashes) == [{6}] * 3
    c.free("a")


def test_a_hit_resumes_at_the_checkpoint_and_reuses_its_whole_bundle():
    c = coordinator()
    hashes = hash_blocks(tokens(160), BS)
    checkpoint_at_112(c, hashes)
    hit = c.find_cached_prefix(hashes, 160)
    assert hit.num_tokens == 112
    (blocks,) = hit.blocks[1:]  # only the state after 112 tokens is read: entry 6
    assert [b.block_id != 0 for b in blocks] == [False] * 6 + [True]
    pages = c.pages(blocks[6].block_id)
    assert c.allocate("b", 140, 112, hit)
    for j, t in enumerate(state_tables(c, "b")):
        assert t[6] == pages[j] and [e for e, b in enumerate(t) if b] == [6, 8]
    c.check_integrity()
    c.free("b")
    c.check_integrity()


def test_an_evicted_checkpoint_frees_its_whole_bundle_and_misses():
    c = coordinator(blocks=24)
    hashes = hash_blocks(tokens(160), BS)
    checkpoint_at_112(c, hashes)
    head = c.pool.get_cached_block(hashes[6], 1)
    assert head is not None and head.ref_cnt == 0 and len(head.pages) == 3
    assert c.pool.num_free_blocks == 23  # the cached bundle is evictable: its tails count as free
    taken = c.pool.get_new_blocks(23)  # reuse takes every block: the head is evicted, its tails follow it
    assert c.pool.get_cached_block(hashes[6], 1) is None and head.pages is None
    assert {b.block_id for b in taken} == set(range(1, 24))
    c.pool.free_blocks(taken)
    c.check_integrity()
    assert c.find_cached_prefix(hashes, 160).num_tokens == 0


@pytest.mark.parametrize("prompt", [112, 113, 128])
def test_a_hit_leaves_the_last_token_and_needs_the_entry_before_the_resume_point(prompt):
    c = coordinator()
    hashes = hash_blocks(tokens(160), BS)
    checkpoint_at_112(c, hashes)
    # 112 tokens: the last must be computed, so the checkpoint at 112 cannot serve; 113 and 128 resume at 112.
    assert c.find_cached_prefix(hashes[: prompt // BS], prompt).num_tokens == (0 if prompt == 112 else 112)


def test_a_finished_request_frees_its_shallower_checkpoints_to_be_evicted_first():
    """Checkpoints at 32 and 64 tokens (chunk ends), both held when the request ends: freed, the one at 32 sits
    nearer the front of the free queue than the one at 64 (same bytes, less compute saved); both stay cached."""
    c = coordinator()
    hashes = hash_blocks(tokens(80), BS)
    step(c, "a", hashes, 0, 32)
    c.remove_skipped_blocks("a", 32)
    step(c, "a", hashes, 32, 32)  # the request ends here, holding both: the old live entry and the new one
    held = [c.pool.get_cached_block(hashes[e], 1) for e in (1, 3)]  # the checkpoints at 32 and 64
    assert all(b is not None for b in held)
    c.free("a")
    order = [b.block_id for b in c.pool.free_queue]
    assert order.index(held[0].block_id) < order.index(held[1].block_id)
    assert cached_state_entries(c, hashes)[0] >= {1, 3}
    c.check_integrity()


def test_a_hit_refreshes_the_cached_checkpoints_on_its_path():
    """A checkpoint at 32 tokens (say, a shared system prompt's end) that requests resuming deeper pass through
    moves to the recent end of the LRU queue when one of them resumes at 64: as walking a radix tree refreshes
    every node on the path, so it outlives a later-freed but unused block."""
    c = coordinator()
    hashes = hash_blocks(tokens(80), BS)
    step(c, "a", hashes, 0, 32)
    c.remove_skipped_blocks("a", 32)
    step(c, "a", hashes, 32, 32)
    c.free("a")
    at_32 = c.pool.get_cached_block(hashes[1], 1)
    other = hash_blocks(tokens(32, seed=9), BS)
    step(c, "x", other, 0, 32)  # an unrelated request: its cached blocks are freed after the checkpoint at 32
    c.free("x")
    later = c.pool.get_cached_block(other[0], 0)
    order = [b.block_id for b in c.pool.free_queue]
    assert order.index(at_32.block_id) < order.index(later.block_id)
    hit = c.find_cached_prefix(hashes, 80)
    assert hit.num_tokens == 64 and at_32 in hit.ancestors
    assert c.allocate("b", 80, 64, hit)
    order = [b.block_id for b in c.pool.free_queue]
    assert order.index(at_32.block_id) > order.index(later.block_id), "the checkpoint on the path was not refreshed"
    c.free("b")
    c.check_integrity()


@pytest.mark.parametrize("prompt", [101, 113])  # the last prompt token inside a block, and first in a new one
def test_a_kept_state_leaves_the_table_and_the_next_step_writes_a_fresh_bundle(prompt):
    """A PD prefill that decodes on: its state before the last prompt token stays for the reader (`keep_state`)."""
    c = coordinator()
    hashes = hash_blocks(tokens(200), BS)
    p1 = prompt - 1
    assert c.allocate("a", p1, 0)
    before = c.state_entries("a", 0, p1)[1]  # the bundle holding the state after p1 tokens
    c.keep_state("a", p1)
    need = sum(m.num_blocks_to_allocate("a", prompt, (), p1) for m in c.managers)
    free = c.pool.num_free_blocks
    step(c, "a", hashes, p1, 1)
    assert need == free - c.pool.num_free_blocks == 3 + (prompt == 113)  # a fresh bundle (+ an attention block)
    source, dest = c.state_entries("a", p1, prompt)
    assert source == before and dest not in (0, before)  # read from the kept bundle, written elsewhere
    assert c.reader_block_ids("a")[1][(p1 - 1) // BS] == before
    assert before not in c.block_ids("a")[1]
    for computed in range(prompt, prompt + 20):  # decoding on never touches it, in place or across blocks
        step(c, "a", hashes, computed, 1)
        assert before not in c.state_entries("a", computed, computed + 1)
        assert c.reader_block_ids("a")[1][(p1 - 1) // BS] == before
    c.keep_state("a", p1)  # asked again (a later step): nothing changes
    step(c, "a", hashes, prompt + 20, 1)
    assert c.reader_block_ids("a")[1][(p1 - 1) // BS] == before
    assert c.blocks_held_per_group()[1] == 2 * 3  # the live bundle and the kept one
    c.free("a")
    c.check_integrity()
    assert c.pool.num_used_blocks == 0
