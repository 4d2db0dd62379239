"""Per-group managers: which blocks one KV cache group holds for each request.

A request's table in a group has one entry per block of tokens [0, num_tokens): entry i covers tokens
[i * bs, (i + 1) * bs). Entries no future token reads (left the sliding window) are the null block, and they are
always the table's first entries: no block is held before a null entry (`remove_skipped_blocks` relies on it).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.plan import KVGroup
from hybridkv.kv.spec import cdiv


class GroupManager:
    """Blocks of one group. Subclasses define which cached prefixes are usable and which blocks can go."""

    def __init__(self, group: KVGroup, pool: BlockPool) -> None:
        self.group_id = group.group_id
        self.spec = group.spec
        self.block_size = group.block_size
        self.pool = pool
        self.tables: dict[str, list[Block]] = {}
        self.ids: dict[str, list[int]] = {}  # the tables' block ids, kept in step with `tables`
        self.num_cached: dict[str, int] = {}  # entries [0, n) were published to the cache map (or are null)

    def find_longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[Block]:
        """Blocks for the longest cached prefix of at most `max_blocks` blocks that this group can resume
        from; entries the next token never reads may be the null block."""
        raise NotImplementedError

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free blocks that no token after `num_computed_tokens` reads, replacing them with the null block."""

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[Block], num_computed_tokens: int = 0
    ) -> int:
        """Free-queue blocks needed to cover `num_tokens` tokens: new blocks plus hit blocks that sit in the
        free queue (a hit revives them). Entries no token after `num_computed_tokens` reads take no block."""
        held = max(len(self.tables.get(req_id, ())) + len(hit), self._first_needed(num_computed_tokens))
        revived = sum(1 for b in hit if b.ref_cnt == 0 and b is not self.pool.null_block)
        return max(0, cdiv(num_tokens, self.block_size) - held) + revived

    def _first_needed(self, num_computed_tokens: int) -> int:
        return self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size

    def usable_hit(self, hit: Sequence[Block], num_computed_tokens: int) -> list[Block]:
        """`hit` with the null block where no token after `num_computed_tokens` reads: a connector load that
        extends the hit past a sliding window leaves the hit's own window unread, so it takes no block."""
        first = min(self._first_needed(num_computed_tokens), len(hit))
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
        skipped = min(self._first_needed(num_computed_tokens), cdiv(num_tokens, self.block_size))
        if len(table) < skipped:
            ids.extend([self.pool.null_block.block_id] * (skipped - len(table)))
            table.extend([self.pool.null_block] * (skipped - len(table)))
        new = self.pool.get_new_blocks(max(0, cdiv(num_tokens, self.block_size) - len(table)))
        table.extend(new)
        ids.extend(b.block_id for b in new)
        return new

    def cache_blocks(self, req_id: str, hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_tokens` tokens."""
        table = self.tables[req_id]
        end = min(num_tokens // self.block_size, len(hashes), len(table))
        for i in range(self.num_cached[req_id], end):
            self.pool.cache_block(table[i], hashes[i], self.group_id)
        self.num_cached[req_id] = max(end, self.num_cached[req_id])

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
        skipped = self._first_needed(num_computed_tokens)
        return 0 < skipped <= len(table) and table[skipped - 1] is not self.pool.null_block


class FullAttentionManager(GroupManager):
    def find_longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[Block]:
        hit: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(GroupManager):
    def find_longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[Block]:
        # Resuming at block h reads tokens [h*bs - W + 1, h*bs): the last `need` blocks before h.
        assert self.spec.window_tokens is not None
        need = cdiv(self.spec.window_tokens - 1, self.block_size)
        null = self.pool.null_block
        hit = [null] * max_blocks
        if need == 0:
            return hit
        run = 0
        for i in range(min(max_blocks, len(hashes)) - 1, -1, -1):  # right to left
            block = self.pool.get_cached_block(hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run == need:
                return hit[: i + need]
        return hit[:run]  # the run that starts at block 0: no earlier tokens exist

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        table = self.tables.get(req_id)
        if not table:
            return
        skipped = min(self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size, len(table))
        null = self.pool.null_block
        freed = []
        ids = self.ids[req_id]
        for i in range(skipped - 1, -1, -1):
            if table[i] is null:
                break  # everything before was released earlier
            freed.append(table[i])
            table[i] = null
            ids[i] = null.block_id
        self.pool.free_blocks(freed)


MANAGERS: dict[str, type[GroupManager]] = {
    "full_attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
}
