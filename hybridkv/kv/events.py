"""KV cache events: plain records of what entered and left a cache tier, for KV-aware routers.

The device prefix cache (`BlockPool`) and the offload tiers append records to a `KVEventLog` as their cached
set changes; the engine drains the log after each step and hands the records to a publisher (`hybridkv.events`),
which puts them on the wire in vLLM's format. Nothing here knows about the wire.

Invariants a consumer relies on (the e2e test rebuilds the cached set from them):
- a `BlockStored` is logged exactly when a (hash, group) key enters the tier's cached set, a `BlockRemoved` exactly
  when it leaves (eviction, a failed fill), an `AllBlocksCleared` when the tier forgets every key; so replaying a
  tier's records in order yields its cached set;
- a `BlockStored`'s hashes are consecutive blocks of one request: `token_ids` has `block_size` tokens per hash,
  and `parent_block_hash` is the hash of the block before the first one (None for a prompt's first block).

Groups. Every KV cache group the pool caches reports its own records with its group id: full attention, sliding
window (a block that left a request's window stays cached until evicted, as in vLLM) and the recurrent-state group
(a state checkpoint after block i is one record under block i's hash, however many pages its bundle has).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.kv.hashing import BlockHash, is_private

# Tier names, as vLLM spells its `medium` field: the device's prefix cache is "GPU" whatever the device (vLLM's
# block pool reports "GPU" on every platform), CPU memory offload "CPU", disk-backed offload "STORAGE".
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one request entered `medium`'s cache for group `group_id`."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_id: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left `medium`'s cache for group `group_id`."""

    block_hashes: tuple[BlockHash, ...]
    group_id: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """`medium`'s cache forgot every block of every group."""

    medium: str = MEDIUM_GPU


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def public(events: Sequence[KVEvent]) -> list[KVEvent]:
    """The records a subscriber may see: none about a salted prefix's blocks (`cache_salt` promises that no other
    tenant learns its prompts; a record's hashes are one request's, so all or none of them are private)."""
    return [e for e in events if isinstance(e, AllBlocksCleared) or not is_private(e.block_hashes[0])]


class KVEventLog:
    """Records in the order the caches changed. Thread-safe: offload I/O threads append too; the engine thread
    drains it once per step."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def append(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def stored(
        self,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        group_id: int,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if hashes:
            self.append(BlockStored(tuple(hashes), parent, tuple(token_ids), block_size, group_id, medium))

    def removed(self, block_hash: BlockHash, group_id: int, medium: str = MEDIUM_GPU) -> None:
        self.append(BlockRemoved((block_hash,), group_id, medium))

    def drain(self) -> list[KVEvent]:
        """Every record logged since the last drain, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
