"""BlockPool: block ids shared by all KV cache groups, reference counts, and the prefix-cache map.

Invariants (checked by `check_integrity`):
- block 0 is the null block: never free, never cached, never counted; it pads skipped table entries.
- a block with ref_cnt == 0 is in the free queue or is a spare bundle's head; a block with ref_cnt > 0 is neither.
- the free queue is LRU: cached blocks freed last are evicted last; uncached blocks are reused first.
- a block is in the cache map under key k iff block.key == k.
- with an event log, every key that enters the cache map is logged as stored by the caller of `cache_block` (which
  knows the tokens; the pool reports whether the key entered), and every key that leaves it is logged here.

Bundles (the recurrent-state group's table entries, `state_plan`): `get_new_bundle(m)` takes m blocks and makes
the lowest one the *head*, which alone is referenced, cached, hit and queued; the head's `pages` lists all m ids.
- the other m - 1 (its tails) have ref_cnt 1, no key and sit in no queue for as long as the head is held,
  queued or spare;
- a head that drops to ref_cnt 0 cached waits in the queue like any cached block; evicting it sends its tails to
  the front of the queue;
- a head that drops to ref_cnt 0 uncached becomes a *spare*: kept whole outside the queue, the next bundle taken
  whole (O(1): a decode that crosses a block end frees one state entry and takes another). A single block is
  taken from the queue's uncached front; where the front would evict a cached block, a spare is dissolved first
  (its m blocks go to the front), so spares never cost a cached block;
- `num_free_blocks` counts the tails of queued heads and all pages of spares.

Idle checkpoints (cached bundle heads in the queue: state checkpoints nobody holds) may be bounded
(`max_idle_checkpoints`, from `state_cache_memory`). Past the bound one is evicted at once, the one with the least
compute saved per byte by Marconi's rule: every bundle has the same bytes, so the score of checkpoint i is
    recency_i + tokens_i / max_tokens        recency_i in [0, 1]: its rank among the idle, oldest 0, newest 1
(the tokens a hit on it skips stand for the compute it saves: a hybrid's per-token work dominates its attention's
quadratic term at these lengths); the lowest score goes, the oldest on a tie.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.kv.blocks import Block, CacheKey, FreeBlockQueue
from hybridkv.kv.events import AllBlocksCleared, KVEventLog
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.residency import ResidencySampler


def _least_compute_per_byte(idle: list[Block]) -> int:
    """Marconi's rule (module docstring): the lowest recency rank + tokens / deepest, the oldest on a tie."""
    deepest = max(b.tokens for b in idle) or 1
    last = max(len(idle) - 1, 1)
    return min(range(len(idle)), key=lambda i: (i / last + idle[i].tokens / deepest, i))


# Which idle checkpoint the bound evicts: the index into the idle ones, least recently queued first.
CHECKPOINT_VICTIMS = {
    "flops_per_byte": _least_compute_per_byte,
    "lru": lambda idle: 0,  # vLLM's and SGLang's order: the least recently used
}


class BlockPool:
    """All block ids of a plan. Groups draw from it; a block belongs to one group at a time."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        events: KVEventLog | None = None,
        max_idle_checkpoints: int | None = None,
        residency: ResidencySampler | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        if max_idle_checkpoints is not None and max_idle_checkpoints < 0:
            raise ValueError(f"max_idle_checkpoints must be >= 0 or None, got {max_idle_checkpoints}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[CacheKey, Block] = {}
        self.enable_caching = enable_caching
        self.events = events  # None: no KV events (the default; nothing is recorded)
        self.residency = residency  # None: no residency sampling (the default)
        self.queued_tails = 0  # tails of the bundle heads in the free queue (freed when those heads are evicted)
        self.spares: list[Block] = []  # uncached free bundles, kept whole (heads; ref_cnt 0, in no queue)
        self.spare_pages = 0
        self.new_bundles: dict[int, tuple[int, ...]] = {}  # formed since `drain_new_bundles`: head -> pages
        self.max_idle_checkpoints = max_idle_checkpoints  # None: no bound but the pool
        self.idle_checkpoints: dict[int, Block] = {}  # cached heads in the queue, least recently queued first
        self.checkpoints_dropped = 0  # idle checkpoints evicted by the bound
        self.checkpoint_victim = "flops_per_byte"  # a key of CHECKPOINT_VICTIMS

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, counting cached blocks nobody holds (evictable) and their tails."""
        return self.free_queue.size + self.queued_tails + self.spare_pages

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    def pages(self, block_id: int) -> tuple[int, ...]:
        """The block ids a table entry stands for: a bundle head's pages, else the block itself."""
        return self.blocks[block_id].pages or (block_id,)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> Block | None:
        return self.cached.get((block_hash, group_id)) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            front = self.free_queue.head.next
            if self.spares and (front is self.free_queue.tail or front.key is not None):
                self._dissolve_spare()  # before any cached block is evicted
            block = self.free_queue.popleft()
            if block.pages is not None:
                self.queued_tails -= len(block.pages) - 1
                self.idle_checkpoints.pop(block.block_id, None)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_new_bundle(self, num_pages: int) -> Block:
        """A new bundle of `num_pages` blocks (ref_cnt 1): its head, the lowest id, whose `pages` are all of them."""
        if self.spares and len(self.spares[-1].pages or ()) == num_pages:
            head = self.spares.pop()  # taken whole
            self.spare_pages -= num_pages
            head.ref_cnt = 1
            self.new_bundles[head.block_id] = head.pages  # type: ignore[assignment]
            return head
        blocks = sorted(self.get_new_blocks(num_pages), key=lambda b: b.block_id)
        pages = tuple(b.block_id for b in blocks)
        if num_pages > 1:
            blocks[0].pages = pages
        self.new_bundles[pages[0]] = pages
        return blocks[0]

    def drain_new_bundles(self) -> dict[int, tuple[int, ...]]:
        """Bundles formed since the last call, head -> pages (a head's pages change only when it heads a new one)."""
        fresh, self.new_bundles = self.new_bundles, {}
        return fresh

    def _evict(self, block: Block) -> None:
        if block.key is not None:
            del self.cached[block.key]
            if self.events is not None:
                self.events.removed(*block.key)
            if self.residency is not None:
                self.residency.evicted(block.block_id)
            block.key = None
        if block.pages is not None:  # an evicted head: its tails are free now, to be used first
            self._dissolve(block)

    def _dissolve(self, head: Block) -> None:
        """Release a head's tails to the front of the queue (the head itself, out of the queue, is the caller's)."""
        assert head.pages is not None
        for page in head.pages[1:]:
            tail = self.blocks[page]
            tail.ref_cnt = 0
            self.free_queue.appendleft(tail)
        head.pages = None

    def _dissolve_spare(self) -> None:
        head = self.spares.pop()
        assert head.pages is not None
        self.spare_pages -= len(head.pages)
        self._dissolve(head)
        self.free_queue.appendleft(head)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks, reviving those that sat in the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.pages is not None:
                    self.queued_tails -= len(block.pages) - 1
                    self.idle_checkpoints.pop(block.block_id, None)
            block.ref_cnt += 1
            if self.residency is not None and block.key is not None:
                self.residency.used(block.block_id)

    def refresh(self, blocks: Iterable[Block]) -> None:
        """Move queued cached blocks to the recent end of the queue (they were just found useful), in order."""
        for block in blocks:
            if block.ref_cnt == 0 and block.key is not None:
                self.free_queue.remove(block)
                self.free_queue.append(block)
                if block.pages is not None:
                    self.idle_checkpoints[block.block_id] = self.idle_checkpoints.pop(block.block_id)

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each, in the given order (callers pass tail blocks first to evict them first)."""
        for block in blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is not None:
                    self.free_queue.append(block)
                    if block.pages is not None:
                        self.queued_tails += len(block.pages) - 1
                        self.idle_checkpoints[block.block_id] = block
                        self._bound_idle_checkpoints()
                elif block.pages is not None:
                    self.spares.append(block)
                    self.spare_pages += len(block.pages)
                else:
                    self.free_queue.appendleft(block)

    def _bound_idle_checkpoints(self) -> None:
        """Evict idle checkpoints past `max_idle_checkpoints`, the lowest score first (module docstring)."""
        bound = self.max_idle_checkpoints
        while bound is not None and len(self.idle_checkpoints) > bound:
            idle = list(self.idle_checkpoints.values())
            head = idle[CHECKPOINT_VICTIMS[self.checkpoint_victim](idle)]
            del self.idle_checkpoints[head.block_id]
            self.free_queue.remove(head)
            self.queued_tails -= len(head.pages or ()) - 1
            self._evict(head)  # its tails go to the front of the queue
            self.free_queue.appendleft(head)
            self.checkpoints_dropped += 1

    def cache_block(self, block: Block, block_hash: BlockHash, group_id: int, tokens: int = 0) -> bool:
        """Publish a full block under its hash (`tokens`: for a state checkpoint, the tokens its state is
        after). A key already taken by another block is left alone, so tables stay append-only and the duplicate
        is freed as an ordinary block. True when the key entered the cache."""
        if not self.enable_caching or block is self.null_block or block.key is not None:
            return False
        key = (block_hash, group_id)
        if key in self.cached:
            return False
        self.cached[key] = block
        block.key = key
        block.tokens = tokens
        if self.residency is not None:
            self.residency.cached(block.block_id)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; returns how many were dropped."""
        n = len(self.cached)
        for block in self.cached.values():
            block.key = None
        self.cached.clear()
        self.idle_checkpoints.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return n

    def cached_hashes(self) -> dict[int, list[BlockHash]]:
        """Group id -> the hashes its cached blocks carry (what KV events report as cached on the device)."""
        out: dict[int, list[BlockHash]] = {}
        for block_hash, group_id in self.cached:
            out.setdefault(group_id, []).append(block_hash)
        return out

    def bundle_heads(self) -> list[Block]:
        return [b for b in self.blocks if b.pages is not None]

    def tail_ids(self) -> list[int]:
        """The tails of every live bundle (held or cached): referenced by their head, not by any table."""
        return [p for head in self.bundle_heads() for p in head.pages[1:]]  # type: ignore[index]

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        assert self.null_block.ref_cnt == 0 and self.null_block.key is None, "null block was used"
        assert self.null_block.prev is None and self.null_block.next is None, "null block is in the free queue"
        in_queue = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in the free queue"
            assert block.ref_cnt == 0, f"{block} is referenced but in the free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.size, "free queue size is off"
        spares = {b.block_id for b in self.spares}
        assert len(spares) == len(self.spares), "a spare bundle is listed twice"
        assert not spares & in_queue, "a spare bundle's head is in the free queue"
        for head in self.spares:
            assert head.key is None and head.pages is not None, f"{head} is no uncached bundle head"
        assert self.spare_pages == sum(len(h.pages or ()) for h in self.spares), "spare pages are miscounted"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block} has a negative reference count"
            free = block.block_id in in_queue or block.block_id in spares
            assert (block.ref_cnt == 0) == free, f"{block} is neither held nor free"
        tails = 0
        for head in self.bundle_heads():
            assert head.pages is not None and head.pages[0] == head.block_id, f"{head} is not its bundle's lowest id"
            assert list(head.pages) == sorted(set(head.pages)), f"{head}'s pages repeat or are unsorted"
            assert head.ref_cnt > 0 or head.block_id in in_queue | spares, f"{head} is neither held nor free"
            tails += (len(head.pages) - 1) * (head.block_id in in_queue)
            for page in head.pages[1:]:
                tail = self.blocks[page]
                assert tail.ref_cnt == 1 and tail.key is None and tail.pages is None, f"{tail} is a bad tail of {head}"
        assert tails == self.queued_tails, f"queued tails {self.queued_tails}, counted {tails}"
        idle = {b.block_id for b in self.bundle_heads() if b.block_id in in_queue and b.key is not None}
        assert set(self.idle_checkpoints) == idle, "idle checkpoints are mis-tracked"
        bound = self.max_idle_checkpoints
        assert bound is None or len(idle) <= bound, f"{len(idle)} idle checkpoints, bound {bound}"
        for key, block in self.cached.items():
            assert block.key == key, f"{block} is cached under a key it does not carry"
        assert sum(b.key is not None for b in self.blocks) == len(self.cached), "a block carries a stale key"
