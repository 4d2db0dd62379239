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

A state kept aside (`keep`, for a PD handoff: the state before the last prompt token, which a decoder resumes
from while this request decodes on): the step that starts at that many tokens reads the live bundle and writes
a fresh one (copy-on-write, no separate copy); the old bundle leaves the table for `kept` and stays until the
request is freed. `kept` and the table never share a block.
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
        self.keep_at: dict[str, int] = {}  # request -> tokens of the state its next step keeps aside
        self.kept: dict[str, tuple[int, Block]] = {}  # request -> (tokens, the bundle holding that state)

    def _live(self, num_tokens: int) -> int:
        """The entry of the state after `num_tokens` tokens; -1 for none (0 tokens: the zero state)."""
        return cdiv(num_tokens, self.block_size) - 1

    def _wanted(self, req_id: str, num_tokens: int, num_computed_tokens: int) -> list[int]:
        """Entries that hold a block after allocate(num_tokens, num_computed_tokens): the two live entries (the
        one read only when the read state is not kept aside)."""
        live_c, live_n = self._live(num_computed_tokens), self._live(num_tokens)
        if self._forks(req_id, num_computed_tokens) or self._kept_tokens(req_id) == num_computed_tokens:
            live_c = -1  # the step reads the kept bundle
        return sorted({e for e in (live_c, live_n) if 0 <= e <= live_n})

    def _kept_tokens(self, req_id: str) -> int | None:
        kept = self.kept.get(req_id)
        return None if kept is None else kept[0]

    def _forks(self, req_id: str, num_computed_tokens: int) -> bool:
        """Whether allocate(_, num_computed_tokens) moves the live bundle aside (`keep` asked for that state)."""
        return (
            self.keep_at.get(req_id) == num_computed_tokens
            and self.held.get(req_id, {}).get(self._live(num_computed_tokens)) == num_computed_tokens
        )

    def keep(self, req_id: str, num_tokens: int) -> None:
        """Keep the state after `num_tokens` tokens (> 0) aside once the step starting there is allocated: that
        step reads it and writes a fresh bundle. Asking again for the state already kept changes nothing."""
        if num_tokens > 0 and self._kept_tokens(req_id) != num_tokens:
            self.keep_at[req_id] = num_tokens

    def kept_entry(self, req_id: str) -> tuple[int, int] | None:
        """(table entry, bundle head) of the state kept aside for `req_id`, or None."""
        kept = self.kept.get(req_id)
        return None if kept is None else (self._live(kept[0]), kept[1].block_id)

    def blocks_outside_tables(self) -> list[Block]:
        """Blocks held besides the tables: the kept states."""
        return [b for _, b in self.kept.values()]

    def _fork(self, req_id: str, num_computed_tokens: int) -> None:
        e = self._live(num_computed_tokens)
        table, ids = self.tables[req_id], self.ids[req_id]
        old = self.kept.pop(req_id, None)
        if old is not None:
            self.pool.free_blocks([old[1]])
        self.kept[req_id] = (num_computed_tokens, table[e])
        del self.keep_at[req_id], self.held[req_id][e]
        table[e], ids[e] = self.pool.null_block, self.pool.null_block.block_id

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, hit: Sequence[Block], num_computed_tokens: int = 0
    ) -> int:
        null = self.pool.null_block
        table = self.tables.get(req_id)
        if table is None:
            table = list(hit)
        forks = self._forks(req_id, num_computed_tokens)
        live_c = self._live(num_computed_tokens)
        wanted = self._wanted(req_id, num_tokens, num_computed_tokens)
        new = sum(1 for e in wanted if e >= len(table) or table[e] is null or (forks and e == live_c))
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
        if self._forks(req_id, num_computed_tokens):
            self._fork(req_id, num_computed_tokens)
        new: list[Block] = []
        for e in self._wanted(req_id, num_tokens, num_computed_tokens):
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
        self.keep_at.pop(req_id, None)
        kept = self.kept.pop(req_id, None)
        if kept is not None:
            self.pool.free_blocks([kept[1]])
        table = self.tables.pop(req_id, [])
        self.ids.pop(req_id, None)
        self.num_cached.pop(req_id, None)
        self.pool.free_blocks(table)

    def step_entries(self, req_id: str, start: int, end: int) -> tuple[int, int]:
        """The bundle heads a chunk of tokens [start, end) reads its state from (entry cdiv(start, bs) - 1; -1
        when start is 0: the zero state) and writes its state to (entry cdiv(end, bs) - 1)."""
        table = self.tables[req_id]
        kept = self.kept.get(req_id)
        if kept is not None and kept[0] == start:
            return kept[1].block_id, table[self._live(end)].block_id
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
        if self._forks(req_id, num_computed_tokens):
            return True
        first = self.spec.first_needed_block(num_computed_tokens)
        return any(e < first for e in held)
