"""Per-group managers: which blocks one KV cache group holds for each request.

A request's table in a group has one entry per block of tokens [0, num_tokens): entry i covers tokens
[i * bs, (i + 1) * bs). Entries no future token reads (before the spec's `first_needed_block`) are the null
block, and for the attention kinds they are always the table's first entries: no block is held before a null
entry (this manager's `remove_skipped_blocks` relies on it; a kind with `interior_nulls` has its own manager,
`state_manager.StateManager`). Everything kind-specific comes from the group's spec; `kinds` pairs each spec
class with its manager class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.events import KVEventLog
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.plan import KVGroup
from hybridkv.kv.spec import cdiv


def log_stored(
    events: KVEventLog,
    entered: Sequence[int],
    hashes: Sequence[BlockHash],
    token_ids: Sequence[int],
    bs: int,
    group: int,
) -> None:
    """Log the blocks at indices `entered` (ascending) as stored in `group`: one record per run of consecutive
    blocks, its parent the hash of the block before the run."""
    run = 0
    for j in range(1, len(entered) + 1):
        if j == len(entered) or entered[j] != entered[j - 1] + 1:
            first, last = entered[run], entered[j - 1]
            parent = hashes[first - 1] if first > 0 else None
            events.stored(hashes[first : last + 1], parent, token_ids[first * bs : (last + 1) * bs], bs, group)
            run = j


class GroupManager:
    """Blocks of one group: the block-table manager of the attention kinds, generic through `self.spec` (which
    cached prefixes are usable: `resume_block`; which blocks can go: `first_needed_block`). A kind whose blocks
    behave otherwise subclasses it and registers the subclass in `kinds`; the coordinator calls only these
    methods and reads `tables` / `ids`."""

    def __init__(self, group: KVGroup, pool: BlockPool) -> None:
        self.group_id = group.group_id
        self.spec = group.spec
        self.block_size = group.block_size
        self.pages_per_entry = group.pages_per_entry  # block ids per table entry (a state bundle's pages)
        self.pool = pool
        self.tables: dict[str, list[Block]] = {}
        self.ids: dict[str, list[int]] = {}  # the tables' block ids, kept in step with `tables`
        self.num_cached: dict[str, int] = {}  # entries [0, n) were published to the cache map (or are null)

    def blocks_outside_tables(self) -> list[Block]:
        """Blocks this group holds besides its tables (none for the attention kinds)."""
        return []

    def find_longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[Block]:
        """Blocks for the longest cached prefix of at most `max_blocks` blocks that this group can resume
        from; entries the next token never reads are the null block."""
        found: dict[int, Block | None] = {}  # block index -> the pool's cached block, asked once each

        def lookup(i: int) -> Block | None:
            if i not in found:
                found[i] = self.pool.get_cached_block(hashes[i], self.group_id) if i < len(hashes) else None
            return found[i]

        k = self.spec.resume_block(lambda i: lookup(i) is not None, 0, max_blocks)
        return self.hit_blocks(k, lookup)

    def hit_blocks(self, num_blocks: int, lookup: Callable[[int], Block | None]) -> list[Block]:
        """The table of a hit of `num_blocks` blocks the spec accepted: the null block before the first block the
        next token reads, then `lookup(i)` (a cached block, present for every i the hit needs)."""
        first = self.spec.first_needed_block(num_blocks * self.block_size)  # <= num_blocks
        hit = [self.pool.null_block] * first
        for i in range(first, num_blocks):
            block = lookup(i)
            assert block is not None, f"group {self.group_id}: a hit of {num_blocks} blocks lacks block {i}"
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free blocks that no token after `num_computed_tokens` reads, replacing them with the null block
        (nothing for full attention, whose first needed block is always 0)."""
        table = self.tables.get(req_id)
        if not table:
            return
        skipped = min(self.spec.first_needed_block(num_computed_tokens), len(table))
        null = self.pool.null_block
        freed = []
        ids = self.ids[req_id]
        for i in range(skipped - 1, -1, -1):  # entries [0, skipped), right to left
            if table[i] is null:
                break  # everything before was released earlier
            freed.append(table[i])
            table[i] = null
            ids[i] = null.block_id
        self.pool.free_blocks(freed)

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[Block], num_computed_tokens: int = 0
    ) -> int:
        """Free-queue blocks needed to cover `num_tokens` tokens: new blocks plus hit blocks that sit in the
        free queue (a hit revives them). Entries no token after `num_computed_tokens` reads take no block."""
        held = max(len(self.tables.get(req_id, ())) + len(hit), self.spec.first_needed_block(num_computed_tokens))
        revived = sum(1 for b in hit if b.ref_cnt == 0 and b is not self.pool.null_block)
        return max(0, cdiv(num_tokens, self.block_size) - held) + revived

    def usable_hit(self, hit: Sequence[Block], num_computed_tokens: int) -> list[Block]:
        """`hit` with the null block where no token after `num_computed_tokens` reads: a connector load that
        extends the hit past a sliding window leaves the hit's own window unread, so it takes no block."""
        first = min(self.spec.first_needed_block(num_computed_tokens), len(hit))
        return [self.pool.null_block] * first + list(hit[first:])

    def add_hit_blocks(self, req_id: str, hit: Sequence[Block]) -> None:
        assert req_id not in self.tables, f"request {req_id} already has blocks; hits apply to new requests"
        self.pool.touch(hit)
        self.tables[req_id] = list(hit)
        self.ids[req_id] = [b.block_id for b in hit]
        self.num_cached[req_id] = len(hit)

    def allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int = 0) -> list[Block]:
        """Extend the table to cover `num_tokens` tokens. A new table whose first `num_computed_tokens` come
        from elsewhere (loaded, not computed) gets the null block where no later token reads."""
        table = self.tables.setdefault(req_id, [])
        ids = self.ids.setdefault(req_id, [])
        self.num_cached.setdefault(req_id, 0)
        skipped = min(self.spec.first_needed_block(num_computed_tokens), cdiv(num_tokens, self.block_size))
        if len(table) < skipped:
            ids.extend([self.pool.null_block.block_id] * (skipped - len(table)))
            table.extend([self.pool.null_block] * (skipped - len(table)))
        new = self.pool.get_new_blocks(max(0, cdiv(num_tokens, self.block_size) - len(table)))
        table.extend(new)
        ids.extend(b.block_id for b in new)
        return new

    def cache_blocks(
        self, req_id: str, hashes: Sequence[BlockHash], num_tokens: int, token_ids: Sequence[int] = ()
    ) -> None:
        """Publish the request's full blocks among its first `num_tokens` tokens. `token_ids` (the request's
        tokens) only feed KV events."""
        table = self.tables[req_id]
        end = min(num_tokens // self.block_size, len(hashes), len(table))
        start = self.num_cached[req_id]
        entered = [i for i in range(start, end) if self.pool.cache_block(table[i], hashes[i], self.group_id)]
        self.num_cached[req_id] = max(end, start)
        if entered and self.pool.events is not None:
            log_stored(self.pool.events, entered, hashes, token_ids, self.block_size, self.group_id)

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, [])
        self.ids.pop(req_id, None)
        self.num_cached.pop(req_id, None)
        self.pool.free_blocks(reversed(table))  # tail blocks are the least likely to be shared: evict first

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.ids.get(req_id, ()))

    def needs_allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> bool:
        """Whether `allocate`/`remove_skipped_blocks` would change this request's table: a new block is due, or
        a block left the window. False is the common decode step inside a block."""
        table = self.tables.get(req_id)
        if table is None or cdiv(num_tokens, self.block_size) > len(table):
            return True
        skipped = self.spec.first_needed_block(num_computed_tokens)
        return 0 < skipped <= len(table) and table[skipped - 1] is not self.pool.null_block
