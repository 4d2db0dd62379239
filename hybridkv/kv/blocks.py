"""Block (one block id's bookkeeping) and FreeBlockQueue (the pool's LRU order of free blocks)."""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.kv.hashing import BlockHash

CacheKey = tuple[BlockHash, int]  # (block hash, group id)


class Block:
    __slots__ = ("block_id", "key", "next", "pages", "prev", "ref_cnt", "tokens")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: CacheKey | None = None
        self.pages: tuple[int, ...] | None = None  # a bundle head: the bundle's block ids, ascending (it is one)
        self.tokens = 0  # a cached bundle head: the tokens its state is after (the compute a hit on it saves)
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with O(1) removal from the middle (a prefix hit revives a block)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self.size += 1

    def append(self, block: Block) -> None:
        assert self.tail.prev is not None
        self._link(block, self.tail.prev, self.tail)

    def appendleft(self, block: Block) -> None:
        assert self.head.next is not None
        self._link(block, self.head, self.head.next)

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        block = self.head.next
        assert block is not None and block is not self.tail, "free queue is empty"
        self.remove(block)
        return block

    def __iter__(self):
        node = self.head.next
        while node is not None and node is not self.tail:
            yield node
            node = node.next
