"""KVCacheCoordinator: one block pool, one manager per group, all-or-nothing allocation across groups."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.events import KVEventLog
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.kinds import manager_for
from hybridkv.kv.managers import GroupManager
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.prefix import common_resume_block, reusable_tokens
from hybridkv.kv.residency import ResidencySampler
from hybridkv.kv.state_manager import StateManager


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix every group accepts: `num_tokens` tokens, and per group the blocks that cover them (the
    null block before the group's first needed block)."""

    num_tokens: int
    blocks: tuple[tuple[Block, ...], ...]
    # Tokens the groups without per-request state (attention) have cached, >= num_tokens: where the request
    # branches off the cached history. A recurrent state checkpoint there lets the next request resume there.
    branch_tokens: int = 0
    # Cached state checkpoints before the one the hit resumes from (on the same path): taking the hit refreshes
    # them in the pool's LRU order, as walking a radix tree refreshes every node on the path.
    ancestors: tuple[Block, ...] = ()

    @staticmethod
    def empty(num_groups: int) -> PrefixHit:
        return PrefixHit(0, tuple(() for _ in range(num_groups)))


class KVCacheCoordinator:
    """Allocates block tables for requests across all KV cache groups of a plan."""

    def __init__(
        self,
        plan: KVPlan,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
        resume_unit: int = 1,
        state_cache_memory: int | None = None,
        residency: ResidencySampler | None = None,
    ) -> None:
        """`events`: where the pool's cached-set changes are logged (KV events); None records nothing.
        `resume_unit`: prefix hits end at a multiple of this many blocks (an exact engine's split unit).
        `state_cache_memory`: bytes the state checkpoints nobody holds may keep (None: what the pool has free).
        `residency`: samples how long cached blocks stay (vLLM's --kv-cache-metrics); None samples nothing."""
        self.plan = plan
        self.resume_unit = resume_unit
        self.block_size = plan.block_size
        idle = None
        if state_cache_memory is not None and plan.state is not None:
            idle = state_cache_memory // plan.state.bytes_per_request
        self.pool = BlockPool(plan.num_blocks, enable_prefix_caching, events, idle, residency)
        self.managers: list[GroupManager] = [manager_for(g.spec)(g, self.pool) for g in plan.groups]
        self.state_manager = None
        if plan.state is not None:
            self.state_manager = self.managers[plan.state.group]
            assert isinstance(self.state_manager, StateManager)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached_prefix(self, hashes: Sequence[BlockHash], num_tokens: int) -> PrefixHit:
        """The longest prefix, in whole blocks, that every group has cached. At least one token of the
        request is left to compute (`reusable_tokens`), so the hit ends before its last token."""
        if not self.pool.enable_caching:
            return PrefixHit.empty(self.num_groups)
        end = min(len(hashes), reusable_tokens(num_tokens) // self.block_size)
        found: dict[tuple[int, int], Block | None] = {}  # (group, block index) -> cached block: one lookup each

        def lookup(g: int, i: int) -> Block | None:
            if (g, i) not in found:
                found[g, i] = self.pool.get_cached_block(hashes[i], self.managers[g].group_id)
            return found[g, i]

        specs = [m.spec for m in self.managers]
        k = common_resume_block(specs, lambda g, i: lookup(g, i) is not None, 0, end, self.resume_unit)
        blocks = tuple(tuple(m.hit_blocks(k, lambda i, g=g: lookup(g, i))) for g, m in enumerate(self.managers))
        branch = k
        stateless = [g for g, spec in enumerate(specs) if not spec.per_request_state]
        if len(stateless) < len(specs) and stateless:
            held = lambda j, i: lookup(stateless[j], i) is not None  # noqa: E731
            branch = common_resume_block([specs[g] for g in stateless], held, k, end)
        ancestors = tuple(
            b for g, spec in enumerate(specs) if spec.per_request_state for i in range(k - 1) if (b := lookup(g, i))
        )
        return PrefixHit(k * self.block_size, blocks, branch * self.block_size, ancestors)

    def allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make every group's table for `req_id` cover tokens [0, num_tokens). Tokens [0, num_computed_tokens)
        are done, so blocks that left a sliding window go first. A `hit` is for a request with no blocks yet.
        Returns False, changing nothing, when the free blocks do not suffice."""
        if hit is None and not any(m.needs_allocate(req_id, num_tokens, num_computed_tokens) for m in self.managers):
            return True  # a decode step inside the current blocks: nothing to free or add
        self.remove_skipped_blocks(req_id, num_computed_tokens)
        if hit is None:
            hit_blocks: tuple[Sequence[Block], ...] = tuple(() for _ in self.managers)
        else:
            hit_blocks = tuple(m.usable_hit(h, num_computed_tokens) for m, h in zip(self.managers, hit.blocks))
        need = sum(
            m.num_blocks_to_allocate(req_id, num_tokens, h, num_computed_tokens)
            for m, h in zip(self.managers, hit_blocks)
        )
        if need > self.pool.num_free_blocks:
            return False
        if hit is not None:
            # Take every group's hits before any new block, so no allocation evicts a block we are reusing.
            for m, h in zip(self.managers, hit_blocks):
                m.add_hit_blocks(req_id, h)
            self.pool.refresh(hit.ancestors)
        for m in self.managers:
            m.allocate(req_id, num_tokens, num_computed_tokens)
        return True

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free, in every group, the blocks no token after the first `num_computed_tokens` reads (sliding-window
        blocks that left the window), leaving the null block in their entries; cached blocks stay cached."""
        for m in self.managers:
            m.remove_skipped_blocks(req_id, num_computed_tokens)

    @property
    def events(self) -> KVEventLog | None:
        return self.pool.events

    def cache_blocks(
        self, req_id: str, hashes: Sequence[BlockHash], num_tokens: int, token_ids: Sequence[int] = ()
    ) -> None:
        """Publish the full blocks among the request's first `num_tokens` tokens, in every group. `token_ids`:
        the request's tokens, which KV events carry (needed only when `events` is set)."""
        for m in self.managers:
            m.cache_blocks(req_id, hashes, num_tokens, token_ids)

    def free(self, req_id: str) -> None:
        for m in self.managers:
            m.free(req_id)

    def block_ids(self, req_id: str) -> list[list[int]]:
        """Per group, the request's block table (0 marks an entry outside the window)."""
        return [m.block_ids(req_id) for m in self.managers]

    def keep_state(self, req_id: str, num_tokens: int) -> None:
        """Keep `req_id`'s recurrent state after `num_tokens` tokens aside from the step that starts there on (a
        PD prefill's state before its last prompt token, while it decodes on); a no-op without a state group."""
        if self.state_manager is not None:
            self.state_manager.keep(req_id, num_tokens)

    def reader_block_ids(self, req_id: str) -> list[list[int]]:
        """`block_ids`, with the state kept aside (`keep_state`) in its entry: what a remote reader of the
        request's prompt reads."""
        tables = self.block_ids(req_id)
        kept = self.state_manager.kept_entry(req_id) if self.state_manager is not None else None
        if kept is not None:
            entry, head = kept
            tables[self.state_manager.group_id][entry] = head
        return tables

    def blocks_held_per_group(self) -> list[int]:
        """Distinct blocks each group's tables hold (shared prefix blocks count once; a bundle counts its pages)."""
        null = self.pool.null_block
        return [
            len({id(b) for t in (*m.tables.values(), m.blocks_outside_tables()) for b in t if b is not null})
            * m.pages_per_entry
            for m in self.managers
        ]

    def pages(self, block_id: int) -> tuple[int, ...]:
        """The block ids a table entry `block_id` stands for (a state bundle's pages; else itself)."""
        return self.pool.pages(block_id)

    def state_entries(self, req_id: str, start: int, end: int) -> tuple[int, int]:
        """For a chunk of tokens [start, end) of `req_id`: the bundle head of the state it starts from (-1 at 0)
        and of the entry it writes (`state.step_entries`); (-1, -1) without a state group."""
        if self.state_manager is None:
            return -1, -1
        return self.state_manager.step_entries(req_id, start, end)

    def drain_new_bundles(self) -> dict[int, tuple[int, ...]]:
        """Bundles formed since the last call: head -> its pages (what the runner's bundle table learns)."""
        return self.pool.drain_new_bundles()

    def check_integrity(self, extra_refs: Counter[int] | None = None) -> None:
        """Pool invariants, plus: each block's reference count equals the tables (and `extra_refs`, e.g. a
        connector's holds) that contain it, no block serves two groups, the block-id lists match the tables, and
        a table's null entries all come before its blocks (unless its kind has `interior_nulls`)."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter(extra_refs or {})
        owner: dict[int, int] = {}
        for m in self.managers:
            assert m.ids.keys() == m.tables.keys(), f"group {m.group_id}: id lists and tables cover other requests"
            for rid, table in m.tables.items():
                assert m.ids[rid] == [b.block_id for b in table], f"group {m.group_id}: stale block ids of {rid}"
                if not m.spec.interior_nulls:  # a kind that allows it (a recurrent state) skips chunk-crossed entries
                    first = next((i for i, b in enumerate(m.ids[rid]) if b != 0), len(table))
                    assert 0 not in m.ids[rid][first:], f"group {m.group_id}: {rid} holds a block before a null entry"
                for b in table:
                    if b is self.pool.null_block:
                        continue
                    refs[b.block_id] += 1
                    assert owner.setdefault(b.block_id, m.group_id) == m.group_id, f"{b} serves two groups"
            for b in m.blocks_outside_tables():
                refs[b.block_id] += 1
                assert owner.setdefault(b.block_id, m.group_id) == m.group_id, f"{b} serves two groups"
        refs.update(self.pool.tail_ids())  # a bundle's tails: one reference each, their head's
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], f"{b} has {refs[b.block_id]} holders"
