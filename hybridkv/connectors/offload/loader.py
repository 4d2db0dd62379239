"""Loader: copies a request's offloaded blocks into the KV blocks the scheduler allocated for it, on one thread.

A load pins what it reads (`TieredStore.prepare_load`). CPU entries are pinned first, then disk entries get a
*pending* CPU slot (reserving one may evict, never a pinned entry): the loader reads the file into it, verifies
it and copies it to the device, so a disk hit leaves the block in the CPU tier too. A key already pending for
another load is read through a private staging buffer instead. The first entry that is missing or corrupt ends
the load with an error; entries verified before it are kept. `collect()` (engine thread) releases the pins of
finished loads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hybridkv.connectors.offload.copier import BlockCopier
from hybridkv.connectors.offload.key import describe
from hybridkv.connectors.offload.stats import OffloadStats
from hybridkv.connectors.offload.store import LoadItem, TieredStore

logger = logging.getLogger(__name__)


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
        store: TieredStore,
        copier: BlockCopier,
        stats: OffloadStats,
        device: torch.device,
        wake: Callable[[], None],
    ) -> None:
        self.store, self.cpu, self.disk, self.copier, self.stats = store, store.cpu, store.disk, copier, stats
        self.wake = wake
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loads: dict[str, Load] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-offload-load")

    def start(self, request_id: str, items: list[LoadItem]) -> None:
        load = Load(request_id, items)
        self.loads[request_id] = load
        load.error = self.store.prepare_load(items)
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
        """Disk entries first (each into its slot, or a row of one staging tensor), then the copies: per group and
        source tensor, one `BlockCopier.from_rows` call that merges runs of blocks into strided copies."""
        start, reading = time.perf_counter(), 0.0
        num_staged = sum(item.slot is None for item in load.items)
        staging = torch.empty((num_staged, self.cpu.slot_bytes), dtype=torch.uint8) if num_staged else None
        batches: dict[tuple[int, bool], tuple[list[int], list[int]]] = {}  # (group, staged) -> (blocks, rows)
        nbytes = staged = 0
        for item in load.items:
            n = self.copier.payload_bytes(item.group)
            if item.slot is not None:
                src, row = self.cpu.data, item.slot
            else:
                src, row, staged = staging, staged, staged + 1
            if item.from_disk:
                assert self.disk is not None
                t0 = time.perf_counter()
                status = self.disk.read(item.key, memoryview(src[row].numpy())[:n])
                if status != "ok":
                    load.error = f"the disk entry of {describe(item.key)} is {status}"
                    return
                item.filled = True
                seconds = time.perf_counter() - t0
                reading += seconds
                self.stats.transfer("disk_to_cpu", n, seconds, 1, 1)
            blocks, rows = batches.setdefault((item.group, item.slot is None), ([], []))
            blocks.append(item.block_id)
            rows.append(row)
            nbytes += n
        copies = 0
        for (group, from_staging), (blocks, rows) in batches.items():
            copies += self.copier.from_rows(group, blocks, rows, staging if from_staging else self.cpu.data)
        if self.stream is not None:
            self.stream.synchronize()  # the blocks are complete before the scheduler hears of it
        seconds = time.perf_counter() - start - reading
        self.stats.transfer("cpu_to_device", nbytes, seconds, len(load.items), copies)

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
            self.store.complete_load(load.items)
        return done

    def any_done(self) -> bool:
        return any(load.future.done() for load in self.loads.values())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
