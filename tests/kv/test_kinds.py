"""The cache-kind table: the built-in kinds, and a new kind that works by registering it alone."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.hashing import hash_blocks
from hybridkv.kv.kinds import CACHE_KINDS, CacheKind, cache_kind, manager_for, register_cache_kind
from hybridkv.kv.managers import GroupManager
from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.spec import AttentionSpec, FullAttentionSpec, SlidingWindowSpec, cdiv
from hybridkv.kv.state import RecurrentStateSpec
from hybridkv.kv.state_manager import StateManager
from tests.kv.util import BS, full, plan, sliding


@dataclass(frozen=True, kw_only=True)
class LastBlockSpec(AttentionSpec):
    """A toy kind in the manner of a recurrent state: resuming at block k reads block k - 1 only."""

    kind: ClassVar[str] = "toy_last_block"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens // self.block_size - 1) * self.block_size

    def blocks_held(self, num_tokens: int) -> int:
        return min(cdiv(num_tokens, self.block_size), 2)

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return min(cdiv(num_tokens, self.block_size), cdiv(max_num_batched_tokens, self.block_size) + 2)


class LastBlockManager(GroupManager):
    """The generic manager, as its own class so the test sees which one the coordinator built."""


def last_block(bs: int = BS) -> LastBlockSpec:
    return LastBlockSpec(num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=bs)


@pytest.fixture
def toy_kind():
    kind = register_cache_kind(CacheKind("toy_last_block", LastBlockSpec, LastBlockManager))
    try:
        yield kind
    finally:
        del CACHE_KINDS["toy_last_block"]


def test_the_table_holds_the_built_in_kinds():
    assert {n: (k.spec, k.manager) for n, k in CACHE_KINDS.items()} == {
        "full_attention": (FullAttentionSpec, GroupManager),
        "sliding_window": (SlidingWindowSpec, GroupManager),
        "recurrent_state": (RecurrentStateSpec, StateManager),
    }
    assert manager_for(full()) is manager_for(sliding()) is GroupManager


def test_a_name_is_registered_once_and_must_match_its_spec():
    before = dict(CACHE_KINDS)
    with pytest.raises(ValueError, match="already registered"):
        register_cache_kind(CacheKind("full_attention", FullAttentionSpec, GroupManager))
    with pytest.raises(ValueError, match="must agree"):
        CacheKind("full_attention", SlidingWindowSpec, GroupManager)
    assert before == CACHE_KINDS
    with pytest.raises(ValueError, match="unknown cache kind 'toy_last_block'; registered: full_attention"):
        cache_kind("toy_last_block")


def test_the_base_resume_rule_serves_a_new_kind():
    """LastBlockSpec overrides nothing of the hit search: KVSpec's scan, from `first_needed_block` alone."""
    for bs in (1, 2, 3):
        spec = last_block(bs)
        for bits in range(1 << 6):
            held = {i for i in range(6) if bits >> i & 1}
            for start in range(7):
                for end in range(start, 7):
                    asked: list[int] = []
                    k = spec.resume_block(lambda i, a=asked, h=held: a.append(i) or i in h, start, end)
                    want = max(k for k in range(start, end + 1) if k == start or k - 1 in held)
                    assert k == want, (bs, held, start, end)
                    assert len(asked) == len(set(asked)), "a block was asked twice"


def test_a_registered_kind_is_planned_and_managed_without_touching_the_core(toy_kind):
    m = ModelKV("toy", (last_block(), full()), {})
    p = plan(m, 64 * 4 * 4096, max_model_len=128, max_num_batched_tokens=16)
    assert [g.kind for g in p.groups] == ["full_attention", "toy_last_block"]  # plan order: full attention first
    c = KVCacheCoordinator(p)
    assert type(c.managers[0]) is GroupManager and type(c.managers[1]) is LastBlockManager
    hashes = hash_blocks(list(range(64)), BS)  # 4 blocks
    assert c.allocate("a", 64, 0)
    c.cache_blocks("a", hashes, 64)
    a_full, a_toy = c.block_ids("a")
    c.free("a")
    hit = c.find_cached_prefix(hashes, 65)
    assert hit.num_tokens == 64 and [b.block_id for b in hit.blocks[0]] == a_full
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, 0, a_toy[3]]  # only the last block is read
    assert c.allocate("b", 65, 64, hit)
    assert c.block_ids("b")[1][:4] == [0, 0, 0, a_toy[3]]
    assert c.allocate("b", 97, 96)  # blocks before block 5 go
    assert c.block_ids("b")[1][:5] == [0] * 5
    c.check_integrity()
    c.free("b")
    c.check_integrity()
    assert c.pool.num_used_blocks == 0
