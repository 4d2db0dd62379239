"""Loader: copies a request's offloaded blocks into the KV blocks the scheduler allocated for it, on one thread.

A load pins what it reads. CPU entries are pinned first, then disk entries get a *pending* CPU slot (reserving
one may evict, never a pinned entry): the loader reads the file into it, verifies it and copies it to the
device, so a disk hit leaves the block in the CPU tier too. A key already pending for another load is read
through a private staging buffer instead. The first entry that is missing or corrupt ends the load with an
error; entries verified before it are kept. `collect()` (engine thread) releases the pins of finished loads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hybridkv.connectors.offload_copy import BlockCopier
from hybridkv.connectors.offload_cpu import CpuTier
from hybridkv.connectors.offload_disk import DiskTier, Key
from hybridkv.connectors.offload_stats import OffloadStats

logger = logging.getLogger(__name__)


@dataclass
class LoadItem:
    group: int
    block_id: int  # the device block to fill
    key: Key
    slot: int | None = None  # a pinned ready CPU entry, or (from disk) a pending one; None: staged
    from_disk: bool = False
    filled: bool = False  # from disk: the pending slot holds the verified entry


@dataclass
class Load:
    request_id: str
    items: list[LoadItem]
    future: Future = field(default_factory=Future)
    error: str | None = None
    aborted: bool = False  # the request is gone: report nothing
    release: bool = False  # aborted mid-copy: the scheduler frees the blocks once the copy is over

    @property
    def ok(self) -> bool:
        return self.error is None and not self.future.cancelled()


class Loader:
    def __init__(
        self,
        cpu: CpuTier,
        disk: DiskTier | None,
        copier: BlockCopier,
        stats: OffloadStats,
        device: torch.device,
        wake: Callable[[], None],
    ) -> None:
        self.cpu, self.disk, self.copier, self.stats = cpu, disk, copier, stats
        self.wake = wake
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loads: dict[str, Load] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-offload-load")

    def start(self, request_id: str, items: list[LoadItem]) -> None:
        load = Load(request_id, items)
        self.loads[request_id] = load
        for item in items:  # every CPU entry first: reserving a slot for a disk entry may evict
            item.slot = self.cpu.pin(item.key)
        for item in items:
            if item.slot is not None:
                continue
            if self.disk is None or not self.disk.contains(item.key):
                load.error = f"block {item.key[0].hex()[:12]} of group {item.group} left the offload tiers"
                break
            item.from_disk = True
            item.slot = self.cpu.allocate(item.key, ready=False)  # None: pending for another load, stage it
        self.stats.add("disk_hit_blocks", sum(i.from_disk for i in items))
        self.stats.add("cpu_hit_blocks", sum(i.slot is not None and not i.from_disk for i in items))
        if load.error is None:
            load.future = self._pool.submit(self._run, load)
        else:
            load.future.set_result(None)
        load.future.add_done_callback(lambda _: self.wake())

    def _run(self, load: Load) -> None:
        """On the loader thread. Any failure becomes `load.error`: the request is recomputed."""
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self._copy_in(load)
        except Exception as e:  # a broken load must never stop the engine
            logger.exception("KV offload: load for request %s failed", load.request_id)
            load.error = f"offload load failed: {e}"

    def _copy_in(self, load: Load) -> None:
        start, reading = time.perf_counter(), 0.0
        nbytes = copies = 0
        for item in load.items:
            n = self.copier.payload_bytes(item.group)
            if item.slot is not None:
                slot = self.cpu.slot(item.slot)
            else:
                slot = torch.empty(self.cpu.slot_bytes, dtype=torch.uint8)
            if item.from_disk:
                assert self.disk is not None
                t0 = time.perf_counter()
                status = self.disk.read(item.key, memoryview(slot.numpy())[:n])
                if status != "ok":
                    load.error = f"the disk entry of block {item.key[0].hex()[:12]} group {item.group} is {status}"
                    return
                item.filled = True
                seconds = time.perf_counter() - t0
                reading += seconds
                self.stats.transfer("disk_to_cpu", n, seconds, 1, 1)
            copies += self.copier.from_slot(item.group, item.block_id, slot)
            nbytes += n
        if self.stream is not None:
            self.stream.synchronize()  # the blocks are complete before the scheduler hears of it
        seconds = time.perf_counter() - start - reading
        self.stats.transfer("cpu_to_device", nbytes, seconds, len(load.items), copies)

    def _release(self, load: Load) -> None:
        for item in load.items:
            if item.slot is None:
                continue
            if not item.from_disk:
                self.cpu.unpin(item.key)
            elif item.filled:
                self.cpu.commit(item.key)
            else:
                self.cpu.discard(item.key)

    def abort(self, request_id: str) -> bool:
        """True: the blocks may be freed now. False: a copy is running; `collect` lists the load when it ends."""
        load = self.loads.get(request_id)
        if load is None:
            return True
        if load.future.cancel() or load.future.done():
            load.aborted = True
            return True
        load.release = True
        return False

    def collect(self) -> list[Load]:
        """Loads that finished since the last call, their pins released."""
        done = [load for load in self.loads.values() if load.future.done()]
        for load in done:
            del self.loads[load.request_id]
            self._release(load)
        return done

    def any_done(self) -> bool:
        return any(load.future.done() for load in self.loads.values())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
