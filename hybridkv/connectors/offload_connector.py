"""OffloadingConnector: full KV blocks go to CPU memory (and through it to disk) as they are computed; a request
whose prefix a tier holds beyond the device's prefix cache loads it instead of computing it.

Keys are (block hash, group). Stores run on the engine thread in `blocks_computed` and finish before it returns
(the next step may reuse freed blocks); the disk copy is written from the CPU slot on a writer thread, so it never
touches device blocks. Loads run on a loader thread into blocks the scheduler allocated and holds until `poll()`
reports them: CPU slot -> device, or disk -> CPU slot -> device. Sliding-window groups store the blocks a request
held and load only the window before the resume point; full-attention groups load every block. A corrupt disk
entry fails the load and the request is recomputed (the blocks read before it stay cached in the CPU tier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hybridkv.connectors.base import ConnectorEvents, EngineIdentity, KVConnector, KVTransferConfig, register_connector
from hybridkv.connectors.descriptors import compat_hash
from hybridkv.connectors.mesh_auth import MeshKeys, load_secret
from hybridkv.connectors.offload_config import CONNECTOR_NAME, OffloadConfig
from hybridkv.connectors.offload_copy import BlockCopier
from hybridkv.connectors.offload_cpu import CpuTier
from hybridkv.connectors.offload_disk import DiskTier, Key
from hybridkv.connectors.offload_loads import Loader, LoadItem
from hybridkv.connectors.offload_stats import OffloadStats
from hybridkv.engine.request import Request
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan

logger = logging.getLogger(__name__)


def _background() -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads one by one): disk writes yield to compute
    where cores are few."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@register_connector(CONNECTOR_NAME)
class OffloadingConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, identity: EngineIdentity) -> None:
        self.options = OffloadConfig.from_transfer_config(config)
        self.keys = MeshKeys.derive(load_secret(self.options.secret_file))  # a bad secret file: ValueError here
        self.identity = identity
        self.stats = OffloadStats()
        self.stored: dict[str, int] = {}  # request -> blocks [0, n) already offered to the tiers
        # Requests looked up in the tiers -> counted yet. A request counts once, however often it is looked up
        # while it waits for blocks or after a preemption: a hit when its first load starts, a miss when it first
        # computes without one. Forgotten when it finishes or is aborted.
        self.looked_up: dict[str, bool] = {}
        self.disk: DiskTier | None = None
        self._writes_pending = 0  # disk writes queued or running (engine thread adds, writer thread subtracts)
        self._writes_lock = threading.Lock()
        self._event = threading.Event()
        self._wake: Callable[[], None] = self._event.set

    def register(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        self.plan = plan
        self.block_size = plan.block_size
        self.copier = BlockCopier(plan, memory)
        slot_bytes = max(self.copier.payload_bytes(g.group_id) for g in plan.groups)
        self._cuda = memory.device.type == "cuda"
        self.cpu = CpuTier(self.options.cpu_bytes, slot_bytes, self.options.eviction, pin_memory=self._cuda)
        if self.options.disk_path is not None:
            compat = compat_hash(plan, self.identity.model_fingerprint, self.identity.dtype)
            options = self.options
            self.disk = DiskTier(
                options.disk_path, compat, options.disk_bytes, options.eviction, slot_bytes, keys=self.keys
            )
        # A thread each: loads never wait behind disk writes. Idle threads hold no reference to this object.
        self.loader = Loader(self.cpu, self.disk, self.copier, self.stats, memory.device, lambda: self._wake())
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-offload-write", initializer=_background)
        auth = "entries keyed by the mesh secret" if self.keys.authenticated else "no mesh secret: checksums only"
        logger.info(
            "KV offloading: %d CPU slots of %d bytes, layout %s (%s copies per block), disk %s",
            self.cpu.num_slots,
            slot_bytes,
            plan.layout,
            "/".join(str(self.copier.copies_per_block(g.group_id)) for g in plan.groups),
            f"{self.disk.dir} ({auth})" if self.disk else "off",
        )

    # ---- lookups -------------------------------------------------------------------------------------------
    def _held(self, key: Key) -> bool:
        return self.cpu.contains(key) or (self.disk is not None and self.disk.contains(key))

    def _group_end(self, group_id: int, hashes: list[BlockHash], start: int, end: int) -> int:
        """The largest k in [start, end] such that this group can resume at block k: the tiers hold every entry
        in [start, k) that a token after block k reads (all of them for full attention, the window otherwise)."""
        spec = self.plan.groups[group_id].spec
        if spec.window_tokens is None:
            k = start
            while k < end and self._held((hashes[k], group_id)):
                k += 1
            return k
        missing_before = [start - 1]  # [k - start]: the last missing entry before block k
        for i in range(start, end):
            missing_before.append(missing_before[-1] if self._held((hashes[i], group_id)) else i)
        for k in range(end, start, -1):
            first = max(start, spec.num_skipped_tokens(k * self.block_size) // self.block_size)
            if missing_before[k - start] < first:
                return k
        return start

    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        start = num_local_tokens // self.block_size
        end = min(len(req.block_hashes), (req.num_prompt_tokens - 1) // self.block_size)  # one token computes
        if end <= start:
            return 0
        self.looked_up.setdefault(req.request_id, False)
        order = sorted(range(len(self.plan.groups)), key=lambda g: self.plan.groups[g].sliding_window is not None)
        k = end
        while True:  # fixed point: every group resumes at the same block
            shorter = k
            for g in order:
                shorter = self._group_end(g, req.block_hashes, start, shorter)
            if shorter == k:
                break
            k = shorter
        if k == start:
            return 0
        for group in self.plan.groups:  # recency: what the request is about to load stays
            first = max(start, group.spec.num_skipped_tokens(k * self.block_size) // self.block_size)
            for i in range(first, k):
                key = (req.block_hashes[i], group.group_id)
                if not self.cpu.touch(key) and self.disk is not None:
                    self.disk.touch(key)
        return (k - start) * self.block_size

    # ---- loads ---------------------------------------------------------------------------------------------
    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        if not self.looked_up.get(req.request_id):  # a request's second load (after a preemption) is no new hit
            self.stats.add("hits")
        self.looked_up[req.request_id] = True
        first = num_local_tokens // self.block_size
        end = (num_local_tokens + req.num_external_tokens) // self.block_size
        items = [
            LoadItem(g, table[i], (req.block_hashes[i], g))
            for g, table in enumerate(block_ids)
            for i in range(first, end)
            if table[i] != 0  # the null block: no token after the resume point reads this entry
        ]
        self.loader.start(req.request_id, items)

    def abort(self, request_id: str) -> bool:
        self.stored.pop(request_id, None)
        self.looked_up.pop(request_id, None)
        return self.loader.abort(request_id)

    def poll(self) -> ConnectorEvents:
        events = ConnectorEvents()
        for load in self.loader.collect():
            rid = load.request_id
            if load.release:
                events.released.append(rid)
            elif not load.aborted:
                events.loaded[rid] = load.ok
                if not load.ok:
                    self.stats.add("load_failures")
                    events.errors[rid] = load.error or "the load was cancelled"
                    logger.warning("request %s: KV load failed (%s): recomputing", rid, events.errors[rid])
        return events

    # ---- stores --------------------------------------------------------------------------------------------
    def blocks_computed(self, req: Request, block_ids: list[list[int]], num_computed_tokens: int) -> None:
        if self.looked_up.get(req.request_id) is False:  # looked up, then computed without a load
            self.looked_up[req.request_id] = True
            self.stats.add("misses")
        full = min(num_computed_tokens // self.block_size, len(req.block_hashes))
        done = self.stored.get(req.request_id, 0)
        if full <= done:
            return
        self.stored[req.request_id] = full
        t0 = time.perf_counter()
        nbytes = blocks = copies = 0
        writes: list[tuple[Key, int, int]] = []
        for i in range(done, full):
            for g, table in enumerate(block_ids):
                if i >= len(table) or table[i] == 0:
                    continue  # a sliding window let this block go
                key = (req.block_hashes[i], g)
                if self.cpu.touch(key) or (self.disk is not None and self.disk.touch(key)):
                    continue
                slot = self.cpu.allocate(key, pin=self.disk is not None)
                if slot is None:
                    self.stats.add("cpu_stores_skipped")  # every slot is being read or written
                    continue
                copies += self.copier.to_slot(g, table[i], self.cpu.slot(slot))
                nbytes, blocks = nbytes + self.copier.payload_bytes(g), blocks + 1
                if self.disk is not None:
                    writes.append((key, slot, g))
        if not blocks:
            return
        if self._cuda:
            torch.cuda.current_stream(self.copier.buffers[0].device).synchronize()  # the slots are complete now
        self.stats.transfer("device_to_cpu", nbytes, time.perf_counter() - t0, blocks, copies)
        for key, slot, g in writes:
            with self._writes_lock:
                self._writes_pending += 1
            self._writer.submit(self._write, key, slot, g)

    def _write(self, key: Key, slot: int, group: int) -> None:
        """On the writer thread: the CPU entry (pinned until now) goes to disk."""
        assert self.disk is not None
        n = self.copier.payload_bytes(group)
        try:
            t0 = time.perf_counter()
            if self.disk.write(key, memoryview(self.cpu.slot(slot).numpy())[:n]):
                self.stats.transfer("cpu_to_disk", n, time.perf_counter() - t0, 1, 1)
        except Exception:
            logger.exception("KV offload: disk write failed")
        finally:
            self.cpu.unpin(key)
            with self._writes_lock:
                self._writes_pending -= 1

    def request_finished(self, req: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        self.stored.pop(req.request_id, None)
        self.looked_up.pop(req.request_id, None)
        return False, None

    # ---- engine loop ---------------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self.loader.loads)

    def wait(self, timeout: float) -> None:
        if self.loader.any_done():
            return
        self._event.wait(timeout)
        self._event.clear()

    def set_waker(self, wake: Callable[[], None]) -> None:
        def both() -> None:
            self._event.set()
            wake()

        self._wake = both

    def flush(self) -> None:
        """Wait until every disk write queued so far is done (tests, shutdown)."""
        if self.disk is not None:
            self._writer.submit(lambda: None).result()

    def check_integrity(self) -> None:
        """Tier invariants; call when idle (no loads in flight, writes flushed)."""
        self.cpu.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

    def metrics(self) -> dict[str, float]:
        out = self.stats.snapshot()
        out |= {
            "kv_offload_cpu_used_bytes": float(self.cpu.used_bytes),
            "kv_offload_cpu_capacity_bytes": float(self.cpu.capacity_bytes),
            "kv_offload_cpu_evictions_total": float(self.cpu.evictions),
            "kv_offload_loads_in_flight": float(len(self.loader.loads)),
            "kv_offload_disk_writes_pending": float(self._writes_pending),
        }
        if self.disk is not None:
            out |= {
                "kv_offload_disk_used_bytes": float(self.disk.used_bytes),
                "kv_offload_disk_capacity_bytes": float(self.disk.capacity_bytes),
                "kv_offload_disk_evictions_total": float(self.disk.evictions),
                "kv_offload_corrupt_entries_total": float(self.disk.corrupt),
                "kv_offload_disk_stores_skipped_total": float(self.disk.skipped),
            }
        return out

    def shutdown(self) -> None:
        self.flush()
        self.loader.shutdown()
        self._writer.shutdown(wait=True)
