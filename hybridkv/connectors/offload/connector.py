"""OffloadingConnector: full KV blocks go to CPU memory (and through it to disk) as they are computed; a request
whose prefix a tier holds beyond the device's prefix cache loads it instead of computing it.

Keys are (block hash, group). Stores run on the engine thread in `blocks_computed` and finish before it returns
(the next step may reuse freed blocks); the disk copy is written from the CPU slot on a writer thread, so it never
touches device blocks. Loads run on a loader thread into blocks the scheduler allocated and holds until `poll()`
reports them: CPU slot -> device, or disk -> CPU slot -> device. Sliding-window groups store the blocks a request
held and load only the window before the resume point; full-attention groups load every block. A corrupt disk
entry fails the load and the request is recomputed (the blocks read before it stay cached in the CPU tier).

A recurrent-state entry (a bundle of m pages, `state_plan`) is stored as m entries of one page each, keyed by
*unit*: page j of state group G is unit G + j (G + j >= the number of groups for j > 0, so units never collide
with groups; the same keys the per-page groups of earlier versions used). Lookups ask for all m units; KV
events report unit G alone, as the group's entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.connectors.base import ConnectorEvents, EngineIdentity, KVConnector, KVTransferConfig, register_connector
from hybridkv.connectors.identity import compat_hash
from hybridkv.connectors.mesh_auth import MeshKeys, load_secret
from hybridkv.connectors.offload.config import CONNECTOR_NAME, OffloadConfig
from hybridkv.connectors.offload.copier import BlockCopier
from hybridkv.connectors.offload.cpu import CpuTier, EntryMeta
from hybridkv.connectors.offload.disk import DiskTier
from hybridkv.connectors.offload.key import Key
from hybridkv.connectors.offload.loader import Loader
from hybridkv.connectors.offload.stats import LOOKUP_SYNC, OffloadStats, vllm_offload_series
from hybridkv.connectors.offload.store import LoadItem, TieredStore
from hybridkv.kv.events import MEDIUM_CPU, KVEventLog
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.histogram import HistogramSnapshot
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.prefix import reusable_tokens
from hybridkv.request.state import Request

logger = logging.getLogger(__name__)


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
        self._event = threading.Event()
        self._wake: Callable[[], None] = self._event.set
        self._kv_events = False  # KV events on: entries carry the chain metadata their stored events report

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
        specs = [g.spec for g in plan.groups]
        self.state_group = plan.state.group if plan.state is not None else None
        if plan.state is not None:  # units G + 1 .. G + m - 1: a state entry's later pages, same table rules
            specs += [plan.groups[plan.state.group].spec] * (plan.state.num_pages - 1)
        self.cpu.event_units = len(plan.groups)
        self.store = TieredStore(self.cpu, self.disk, specs, self.copier, self.stats)
        # A thread each: loads never wait behind disk writes. Idle threads hold no reference to this object.
        self.loader = Loader(self.store, self.copier, self.stats, memory.device, lambda: self._wake())
        auth = "entries keyed by the mesh secret" if self.keys.authenticated else "no mesh secret: checksums only"
        logger.info(
            "KV offloading: %d CPU slots of %d bytes, layout %s (%s copies per block), disk %s",
            self.cpu.num_slots,
            slot_bytes,
            plan.layout,
            "/".join(str(self.copier.copies_per_block(g.group_id)) for g in plan.groups),
            f"{self.disk.dir} ({auth})" if self.disk else "off",
        )

    # ---- KV events -----------------------------------------------------------------------------------------
    def set_kv_events(self, events: KVEventLog) -> None:
        """The CPU tier logs its entries (medium "CPU"). The disk tier logs nothing yet: it is shared by
        instances and outlives them, so no one instance's stream could describe it."""
        self.cpu.events = events
        self._kv_events = True

    def kv_event_tiers(self) -> dict[str, dict[int, list[BlockHash]]]:
        out: dict[int, list[BlockHash]] = {}
        for block_hash, unit in self.cpu.ready_keys():
            if unit < len(self.plan.groups):  # a state entry's later pages are reported through its first
                out.setdefault(unit, []).append(block_hash)
        return {MEDIUM_CPU: out}

    def _meta(self, req: Request, i: int) -> EntryMeta | None:
        """What block `i` of `req` says in its stored event (None without KV events)."""
        if not self._kv_events:
            return None
        bs = self.block_size
        parent = req.block_hashes[i - 1] if i > 0 else None
        return parent, tuple(req.all_token_ids[i * bs : (i + 1) * bs]), bs

    def _units(self, group: int, block_id: int) -> list[tuple[int, int]]:
        """(unit, block id) of each page table entry `block_id` of `group` stands for (see the module docstring)."""
        if group != self.state_group:
            return [(group, block_id)]
        return [(group + j, page) for j, page in enumerate(self.pages(block_id))]

    # ---- lookups -------------------------------------------------------------------------------------------
    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        start = num_local_tokens // self.block_size
        end = min(len(req.block_hashes), reusable_tokens(req.num_prompt_tokens) // self.block_size)
        if end <= start:
            return 0
        self.looked_up.setdefault(req.request_id, False)
        t0 = time.perf_counter()
        k = self.store.lookup(req.block_hashes, start, end, self.resume_unit)
        self.stats.histograms[LOOKUP_SYNC].observe(time.perf_counter() - t0)
        if k == start:
            return 0
        self.store.touch(req.block_hashes, start, k)  # recency: what the request is about to load stays
        return (k - start) * self.block_size

    # ---- loads ---------------------------------------------------------------------------------------------
    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        if not self.looked_up.get(req.request_id):  # a request's second load (after a preemption) is no new hit
            self.stats.add("hits")
        self.looked_up[req.request_id] = True
        first = num_local_tokens // self.block_size
        end = (num_local_tokens + req.num_external_tokens) // self.block_size
        items = [
            LoadItem(g, page, (req.block_hashes[i], unit), meta=self._meta(req, i) if unit == g else None)
            for g, table in enumerate(block_ids)
            for i in range(first, end)
            if table[i] != 0  # the null block: no token after the resume point reads this entry
            for unit, page in self._units(g, table[i])
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
        stored: list[tuple[Key, int]] = []
        for i in range(done, full):
            for g, table in enumerate(block_ids):
                if i >= len(table) or table[i] == 0:
                    continue  # a sliding window let this block go
                for unit, page in self._units(g, table[i]):
                    key = (req.block_hashes[i], unit)
                    slot = self.store.prepare_store(key, self._meta(req, i) if unit == g else None)
                    if slot is None:
                        continue
                    copies += self.copier.to_slot(g, page, self.cpu.slot(slot))
                    nbytes, blocks = nbytes + self.copier.payload_bytes(g), blocks + 1
                    stored.append((key, slot))
        if not blocks:
            return
        if self._cuda:
            torch.cuda.current_stream(self.copier.buffers[0].device).synchronize()  # the slots are complete now
        self.stats.transfer("device_to_cpu", nbytes, time.perf_counter() - t0, blocks, copies)
        self.store.complete_store(stored)

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
        self.store.flush()

    def check_integrity(self) -> None:
        """Tier invariants; call when idle (no loads in flight, writes flushed)."""
        self.store.check_integrity()

    def metrics(self) -> dict[str, float]:
        out = self.stats.snapshot()
        out |= {
            "kv_offload_cpu_used_bytes": float(self.cpu.used_bytes),
            "kv_offload_cpu_capacity_bytes": float(self.cpu.capacity_bytes),
            "kv_offload_cpu_evictions_total": float(self.cpu.evictions),
            "kv_offload_loads_in_flight": float(len(self.loader.loads)),
            "kv_offload_disk_writes_pending": float(self.store.writes_pending),
        }
        if self.disk is not None:
            out |= {
                "kv_offload_disk_used_bytes": float(self.disk.used_bytes),
                "kv_offload_disk_capacity_bytes": float(self.disk.capacity_bytes),
                "kv_offload_disk_evictions_total": float(self.disk.evictions),
                "kv_offload_corrupt_entries_total": float(self.disk.corrupt),
                "kv_offload_disk_stores_skipped_total": float(self.disk.skipped),
            }
        loading = sum(len(load.items) for load in list(self.loader.loads.values()))  # slots being copied in
        used = self.cpu.used_bytes // self.cpu.slot_bytes
        return out | vllm_offload_series(out, self.cpu.num_slots, used, loading, self.store.writes_pending)

    def fetch_stages(self) -> dict[str, int]:
        return {"in_progress": len(self.loader.loads)}  # a lookup answers at once: loads start when admitted

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return {name: h.snapshot() for name, h in self.stats.histograms.items()}

    def shutdown(self) -> None:
        self.store.flush()
        self.loader.shutdown()
        self.store.shutdown()
