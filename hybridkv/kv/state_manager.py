"""StateManager: the block tables of the recurrent-state group (table semantics in `state.py`).

A table entry is a bundle (`state_plan`): one head block standing for the m pages of one state, allocated and
freed as one (`BlockPool.get_new_bundle`), so every method here does the same work whatever m is.

Per request the manager keeps `held`: table entry -> tokens of the state that entry holds, for exactly the
entries that hold a block (never more than the old and the new live entry, plus nothing else), so no call
scans a whole table. Invariants:
- after `allocate(req, n, c)` the table has cdiv(n, bs) entries; the blocks sit at the live entry of c (read by
  the step; kept until `remove_skipped_blocks` passes it) and the live entry of n (written by the step); every
  other entry is the null block;
- the last entry of a table is the live entry of the tokens it was allocated for, so once cache_blocks is told
  that (e + 1) * bs tokens are computed for a last entry e, that entry holds the state after exactly that many
  (the table covers no token past it); an older entry's state is the one recorded when it was the old live entry;
- an entry is published only when it holds the state after exactly (e + 1) * bs tokens, and a published entry
  is never written again (every later step's live entry lies after it).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers import GroupManager, log_stored
from hybridkv.kv.spec import cdiv


class StateManager(GroupManager):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, dict[int, int]] = {}  # request -> {entry holding a block: tokens of its state}

    def _live(self, num_tokens: int) -> int:
        """The entry of the state after `num_tokens` tokens; -1 for none (0 tokens: the zero state)."""
        return cdiv(num_tokens, self.block_size) - 1

    def _wanted(self, num_tokens: int, num_computed_tokens: int) -> list[int]:
        """Entries that hold a block after allocate(num_tokens, num_computed_tokens): the two live entries."""
        live_c, live_n = self._live(num_computed_tokens), self._live(num_tokens)
        return sorted({e for e in (live_c, live_n) if 0 <= e <= live_n})

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[Block], num_computed_tokens: int = 0
    ) -> int:
        null = self.pool.null_block
        table = self.tables.get(req_id)
        if table is None:
            table = list(hit)
        new = sum(1 for e in self._wanted(num_tokens, num_computed_tokens) if e >= len(table) or table[e] is null)
        revived = sum(1 for b in hit if b.ref_cnt == 0 and b is not null)
        return (new + revived) * self.pages_per_entry

    def add_hit_blocks(self, req_id: str, hit: Sequence[Block]) -> None:
        super().add_hit_blocks(req_id, hit)
        # A hit's blocks are checkpoints: entry e holds the state after (e + 1) * bs tokens.
        self.held[req_id] = {e: (e + 1) * self.block_size for e, b in enumerate(hit) if b is not self.pool.null_block}

    def allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int = 0) -> list[Block]:
        table = self.tables.setdefault(req_id, [])
        ids = self.ids.setdefault(req_id, [])
        held = self.held.setdefault(req_id, {})
        self.num_cached.setdefault(req_id, 0)
        null = self.pool.null_block
        size = cdiv(num_tokens, self.block_size)
        if len(table) < size:
            ids.extend([null.block_id] * (size - len(table)))
            table.extend([null] * (size - len(table)))
        live_n = self._live(num_tokens)
        new: list[Block] = []
        for e in self._wanted(num_tokens, num_computed_tokens):
            if table[e] is null:
                block = self.pool.get_new_bundle(self.pages_per_entry)
                table[e], ids[e] = block, block.block_id
                new.append(block)
            # What the entry holds once the step ran: c tokens (read) or n tokens (written).
            held[e] = num_tokens if e == live_n else num_computed_tokens
        return new

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free every held entry before the live one: null entries may sit anywhere, so walk `held`, not the table."""
        held = self.held.get(req_id)
        if not held:
            return
        first = self.spec.first_needed_block(num_computed_tokens)
        table, ids = self.tables[req_id], self.ids[req_id]
        freed = []
        for e in sorted((e for e in held if e < first), reverse=True):
            freed.append(table[e])
            table[e] = self.pool.null_block
            ids[e] = self.pool.null_block.block_id
            del held[e]
        self.pool.free_blocks(freed)

    def cache_blocks(
        self, req_id: str, hashes: Sequence[BlockHash], num_tokens: int, token_ids: Sequence[int] = ()
    ) -> None:
        """Publish the held entries that are checkpoints among the first `num_tokens` computed tokens: entry e
        when it holds the state after exactly (e + 1) * bs tokens and (e + 1) * bs <= num_tokens."""
        table, held = self.tables[req_id], self.held.get(req_id, {})
        last = len(table) - 1
        entered = []
        for e, tokens in held.items():
            end = (e + 1) * self.block_size
            if end > num_tokens or e >= len(hashes):
                continue
            if e == last:
                tokens = held[e] = end  # computed reached the table's end: the live state is after exactly `end`
            if tokens == end and self.pool.cache_block(table[e], hashes[e], self.group_id, tokens=end):
                entered.append(e)
        if entered and self.pool.events is not None:
            log_stored(self.pool.events, sorted(entered), hashes, token_ids, self.block_size, self.group_id)

    def free(self, req_id: str) -> None:
        """Free front to back: freed cached blocks are evicted in the order freed, so a request's shallower
        checkpoints go before its deeper ones, which save more compute for the same bytes (Marconi's FLOP
        efficiency, within one request; across requests the pool's LRU order stands: a reused checkpoint is
        touched back to the recent end, and so are the cached checkpoints before it (`PrefixHit.ancestors`))."""
        self.held.pop(req_id, None)
        table = self.tables.pop(req_id, [])
        self.ids.pop(req_id, None)
        self.num_cached.pop(req_id, None)
        self.pool.free_blocks(table)

    def step_entries(self, req_id: str, start: int, end: int) -> tuple[int, int]:
        """The bundle heads a chunk of tokens [start, end) reads its state from (entry cdiv(start, bs) - 1; -1
        when start is 0: the zero state) and writes its state to (entry cdiv(end, bs) - 1)."""
        table = self.tables[req_id]
        source = -1 if start == 0 else table[self._live(start)].block_id
        return source, table[self._live(end)].block_id

    def needs_allocate(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> bool:
        """False exactly when the step stays inside the live entry and no older entry is held."""
        table = self.tables.get(req_id)
        if table is None or cdiv(num_tokens, self.block_size) > len(table):
            return True
        held = self.held.get(req_id, {})
        if self._live(num_tokens) not in held and num_tokens > 0:
            return True
        first = self.spec.first_needed_block(num_computed_tokens)
        return any(e < first for e in held)
