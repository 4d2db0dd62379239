"""TieredStore: the CPU tier and the disk tier behind it, seen by the connector as one store of block entries.

Verbs, in the order a request meets them:

    lookup         -> the block a request can resume at from the tiers (every group agrees; the hit rule is
                      the KV core's `common_resume_block`, the one the device prefix cache uses)
    touch          -> what a request is about to load becomes most recent in its tier
    prepare_load   -> pin the CPU entries of a load and reserve pending CPU slots for its disk entries
    complete_load  -> release those pins: a verified disk entry stays in the CPU tier, a failed one is dropped
    prepare_store  -> a CPU slot for an entry the tiers do not hold yet (None: held already, or no free slot)
    complete_store -> queue the stored entries' disk copies on the writer thread

Invariant: an entry is read or written only while pinned (loads, disk writes), so eviction never takes a slot in
use. Only the engine thread calls the verbs; the loader and writer threads only unpin, commit and discard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hybridkv.connectors.offload.copier import BlockCopier
from hybridkv.connectors.offload.cpu import CpuTier, EntryMeta
from hybridkv.connectors.offload.disk import DiskTier
from hybridkv.connectors.offload.key import Key, describe
from hybridkv.connectors.offload.stats import OffloadStats
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.prefix import common_resume_block
from hybridkv.kv.spec import KVSpec

logger = logging.getLogger(__name__)


@dataclass
class LoadItem:
    group: int
    block_id: int  # the device block to fill
    key: Key
    slot: int | None = None  # a pinned ready CPU entry, or (from disk) a pending one; None: staged
    from_disk: bool = False
    filled: bool = False  # from disk: the pending slot holds the verified entry
    meta: EntryMeta | None = None  # with KV events: what the entry's stored event says once it is a CPU entry


def _background() -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads one by one): disk writes yield to compute
    where cores are few."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class TieredStore:
    def __init__(
        self, cpu: CpuTier, disk: DiskTier | None, specs: Sequence[KVSpec], copier: BlockCopier, stats: OffloadStats
    ) -> None:
        self.cpu, self.disk, self.specs, self.copier, self.stats = cpu, disk, tuple(specs), copier, stats
        self.block_size = self.specs[0].block_size
        self.writes_pending = 0  # disk writes queued or running (engine thread adds, writer thread subtracts)
        self._writes_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-offload-write", initializer=_background)

    def held(self, key: Key) -> bool:
        return self.cpu.contains(key) or (self.disk is not None and self.disk.contains(key))

    # ---- lookups -------------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash], start: int, end: int, unit: int = 1) -> int:
        """The largest block k in [start, end] every group can resume at: the tiers hold each entry in [start, k)
        that a token after block k reads (all of them for full attention, the window for sliding groups); k is
        `start` or a multiple of `unit`."""
        return common_resume_block(self.specs, lambda g, i: self.held((hashes[i], g)), start, end, unit)

    def touch(self, hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Entries [start, end) that a resume at block `end` reads, per group, become the most recent."""
        for g, spec in enumerate(self.specs):
            for i in range(max(start, spec.first_needed_block(end * self.block_size)), end):
                key = (hashes[i], g)
                if not self.cpu.touch(key) and self.disk is not None:
                    self.disk.touch(key)

    # ---- loads ---------------------------------------------------------------------------------------------
    def prepare_load(self, items: list[LoadItem]) -> str | None:
        """Pin every CPU entry first (reserving a slot for a disk entry may evict), then reserve pending slots
        for disk entries (None: pending for another load, read through a staging buffer). Returns the error of
        the first entry no tier holds any more; the pins taken stay until `complete_load`."""
        for item in items:
            item.slot = self.cpu.pin(item.key)
        error = None
        for item in items:
            if item.slot is not None:
                continue
            if self.disk is None or not self.disk.contains(item.key):
                error = f"{describe(item.key)} left the offload tiers"
                break
            item.from_disk = True
            item.slot = self.cpu.allocate(item.key, ready=False, meta=item.meta)
        self.stats.add("disk_hit_blocks", sum(i.from_disk for i in items))
        self.stats.add("cpu_hit_blocks", sum(i.slot is not None and not i.from_disk for i in items))
        return error

    def complete_load(self, items: list[LoadItem]) -> None:
        """Release a finished load's pins: a disk entry that was read and verified becomes a ready CPU entry."""
        for item in items:
            if item.slot is None:
                continue
            if not item.from_disk:
                self.cpu.unpin(item.key)
            elif item.filled:
                self.cpu.commit(item.key)
            else:
                self.cpu.discard(item.key)

    # ---- stores --------------------------------------------------------------------------------------------
    def prepare_store(self, key: Key, meta: EntryMeta | None = None) -> int | None:
        """A CPU slot to copy `key`'s block into, pinned for its disk write when there is a disk tier; None when a
        tier holds the entry already (it becomes the most recent) or every slot is being read or written. `meta`:
        for the entry's KV event."""
        if self.cpu.touch(key) or (self.disk is not None and self.disk.touch(key)):
            return None
        slot = self.cpu.allocate(key, pin=self.disk is not None, meta=meta)
        if slot is None:
            self.stats.add("cpu_stores_skipped")
        return slot

    def complete_store(self, stored: list[tuple[Key, int]]) -> None:
        """The CPU slots of `stored` (key, slot) hold their blocks: copy them to disk on the writer thread."""
        if self.disk is None:
            return
        for key, slot in stored:
            with self._writes_lock:
                self.writes_pending += 1
            self._writer.submit(self._write, key, slot)

    def _write(self, key: Key, slot: int) -> None:
        """On the writer thread: the CPU entry (pinned until now) goes to disk."""
        assert self.disk is not None
        try:
            n = self.copier.payload_bytes(key[1])
            t0 = time.perf_counter()
            if self.disk.write(key, memoryview(self.cpu.slot(slot).numpy())[:n]):
                self.stats.transfer("cpu_to_disk", n, time.perf_counter() - t0, 1, 1)
        except Exception:
            logger.exception("KV offload: disk write failed")
        finally:
            self.cpu.unpin(key)
            with self._writes_lock:
                self.writes_pending -= 1

    def flush(self) -> None:
        """Wait until every disk write queued so far is done (tests, shutdown)."""
        if self.disk is not None:
            self._writer.submit(lambda: None).result()

    def check_integrity(self) -> None:
        """Tier invariants; call when idle (no loads in flight, writes flushed)."""
        self.cpu.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

    def shutdown(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
