"""CpuTier: offloaded KV blocks in CPU memory, one fixed-size slot per (block hash, group).

All slots live in one uint8 tensor allocated up front (pinned when CUDA is available, so device copies can run
asynchronously). An entry is *ready* once its bytes are in its slot; a *pending* entry (being filled from disk) is
invisible to `contains`. A pinned entry is being read (a load, a disk write) or filled, so it is never evicted and
its slot never reused. Thread-safe: the engine thread stores and pins, I/O threads unpin and read pinned slots.

KV events (`events` set): an entry is logged as stored when it becomes ready (with the chain metadata its caller
gave), as removed when it is evicted; a pending entry that is discarded was never visible, so it logs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from hybridkv.connectors.offload.policy import make_policy
from hybridkv.kv.events import MEDIUM_CPU, BlockStored, KVEventLog
from hybridkv.kv.hashing import BlockHash

# What a stored event says about an entry besides its key: (parent hash, the block's token ids, block size).
EntryMeta = tuple[BlockHash | None, tuple[int, ...], int]


@dataclass
class _Entry:
    slot: int
    ready: bool
    pins: int = 0
    meta: EntryMeta | None = None  # for its stored event, until it becomes ready


class CpuTier:
    def __init__(self, capacity_bytes: int, slot_bytes: int, eviction: str = "lru", pin_memory: bool = False) -> None:
        self.num_slots = capacity_bytes // slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"the CPU offload tier of {capacity_bytes} bytes holds no block: one block takes {slot_bytes} "
                "bytes; raise cpu_bytes (--kv-offload-cpu)"
            )
        self.slot_bytes = slot_bytes
        self.data = torch.empty((self.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._entries: dict[Hashable, _Entry] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._policy = make_policy(eviction, self.num_slots)
        self._lock = threading.Lock()
        self.evictions = 0
        self.events: KVEventLog | None = None  # KV events of this tier (medium "CPU"); keys are (hash, unit)
        self.event_units = 1 << 62  # keys of units >= this (a state entry's later pages) log no events

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return (self.num_slots - len(self._free)) * self.slot_bytes

    def __len__(self) -> int:
        with self._lock:
            return sum(e.ready for e in self._entries.values())

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.ready

    def touch(self, key: Hashable) -> bool:
        """Mark a ready entry as used; False when there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                return False
            self._policy.touch(key)
            return True

    def allocate(
        self, key: Hashable, *, ready: bool = True, pin: bool = False, meta: EntryMeta | None = None
    ) -> int | None:
        """A slot for a new entry, evicting an unpinned one if the tier is full. The caller fills the slot before
        anything else can read it: a ready entry on the engine thread right away, a pending one before `commit`.
        None: the key is already present, or every slot is pinned. `meta`: for the entry's KV event."""
        with self._lock:
            if key in self._entries:
                return None
            if not self._free:
                victim = self._policy.evict(lambda k: self._entries[k].pins == 0)
                if victim is None:
                    return None
                self._free.append(self._entries.pop(victim).slot)
                self.evictions += 1
                if self.events is not None and victim[1] < self.event_units:
                    self.events.removed(*victim, medium=MEDIUM_CPU)
            slot = self._free.pop()
            entry = _Entry(slot, ready, pins=int(pin) + int(not ready), meta=meta)
            self._entries[key] = entry
            self._policy.insert(key)
            if ready:
                self._log_stored(key, entry)
            return slot

    def _log_stored(self, key: Hashable, entry: _Entry) -> None:
        """Log a newly ready entry (lock held, so records follow the order entries change)."""
        if self.events is not None and key[1] < self.event_units:
            parent, tokens, block_size = entry.meta or (None, (), 0)
            self.events.append(BlockStored((key[0],), parent, tokens, block_size, key[1], MEDIUM_CPU))
        entry.meta = None

    def pin(self, key: Hashable) -> int | None:
        """Protect a ready entry while its slot is read; returns the slot, or None when the entry is absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                return None
            entry.pins += 1
            self._policy.touch(key)
            return entry.slot

    def unpin(self, key: Hashable) -> None:
        with self._lock:
            self._entries[key].pins -= 1

    def commit(self, key: Hashable) -> None:
        """A pending entry's slot is filled: make it ready (and drop the pin `allocate` took)."""
        with self._lock:
            entry = self._entries[key]
            entry.ready, entry.pins = True, entry.pins - 1
            self._log_stored(key, entry)

    def discard(self, key: Hashable) -> None:
        """Drop a pending entry whose fill failed; its slot is free again."""
        with self._lock:
            entry = self._entries.pop(key)
            self._policy.remove(key)
            self._free.append(entry.slot)

    def ready_keys(self) -> list[Hashable]:
        """The keys of every ready entry (what this tier's KV events report as held)."""
        with self._lock:
            return [k for k, e in self._entries.items() if e.ready]

    def slot(self, index: int) -> torch.Tensor:
        return self.data[index]

    def check_integrity(self) -> None:
        """Every slot is free or owned by exactly one entry; no pins are left once I/O is idle."""
        with self._lock:
            owned = [e.slot for e in self._entries.values()]
            assert len(set(owned)) == len(owned), "a slot has two entries"
            assert not set(owned) & set(self._free), "a slot is both free and owned"
            assert len(owned) + len(self._free) == self.num_slots, "a slot is lost"
            assert len(self._policy) == len(self._entries), "the eviction policy and the entries disagree"
            assert all(e.pins == 0 for e in self._entries.values()), "an entry is still pinned"
