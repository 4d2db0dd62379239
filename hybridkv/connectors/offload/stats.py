"""OffloadStats: the OffloadingConnector's counters, written from the engine thread and its I/O threads.

Per direction (device_to_cpu, cpu_to_device, cpu_to_disk, disk_to_cpu): bytes, seconds, blocks and copies (one per
contiguous span moved); plus lookups that hit or missed, blocks served by each tier, failed loads and stores
skipped for want of a free CPU slot. Names are /metrics names without the hybridkv_ prefix.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from hybridkv.kv.histogram import BYTES, SECONDS, CumulativeHistogram

DIRECTIONS = ("device_to_cpu", "cpu_to_device", "cpu_to_disk", "disk_to_cpu")
COUNTERS = ("hits", "misses", "cpu_hit_blocks", "disk_hit_blocks", "load_failures", "cpu_stores_skipped")


# vLLM's per-transfer histograms, by direction: bytes per load (CPU -> device) and per store (device -> CPU); and
# how long a lookup took (ours answer at once: the async one, time a lookup stays deferred, stays empty).
SIZE_HISTOGRAMS = {"cpu_to_device": "vllm:kv_offload_load_size", "device_to_cpu": "vllm:kv_offload_store_size"}
LOOKUP_SYNC = "vllm:kv_offload_lookup_sync_delay_seconds"
LOOKUP_ASYNC = "vllm:kv_offload_lookup_async_delay_seconds"


class OffloadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
        self.histograms = {name: CumulativeHistogram(BYTES) for name in SIZE_HISTOGRAMS.values()}
        self.histograms |= {LOOKUP_SYNC: CumulativeHistogram(SECONDS), LOOKUP_ASYNC: CumulativeHistogram(SECONDS)}
        for d in DIRECTIONS:
            self.transfer(d, 0, 0.0, 0, 0)
        for name in COUNTERS:
            self.add(name, 0)

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._values[f"kv_offload_{name}_total"] += value

    def transfer(self, direction: str, nbytes: int, seconds: float, blocks: int, copies: int) -> None:
        with self._lock:
            for what, value in (("bytes", nbytes), ("seconds", seconds), ("blocks", blocks), ("copies", copies)):
                self._values[f"kv_offload_{direction}_{what}_total"] += value
        if blocks and direction in SIZE_HISTOGRAMS:
            self.histograms[SIZE_HISTOGRAMS[direction]].observe(nbytes)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


def vllm_offload_series(ours: dict[str, float], slots: int, used: int, loading: int, writing: int) -> dict[str, float]:
    """vLLM's OffloadingConnector series from ours: load = CPU -> device, store = device -> CPU; stores skipped for
    want of a free CPU slot are its allocation failures (and, with the disk tier's skipped writes, its skipped
    stores); usage is the share of CPU slots pinned by transfers in flight (loads copying in, disk writes
    reading out). A name may carry one label: 'name{label="value"}'."""
    read, write = loading / slots, writing / slots
    return {
        "vllm:kv_offload_load_bytes_total": ours["kv_offload_cpu_to_device_bytes_total"],
        "vllm:kv_offload_load_time_total": ours["kv_offload_cpu_to_device_seconds_total"],
        "vllm:kv_offload_store_bytes_total": ours["kv_offload_device_to_cpu_bytes_total"],
        "vllm:kv_offload_store_time_total": ours["kv_offload_device_to_cpu_seconds_total"],
        "vllm:kv_offload_allocation_failure_total": ours["kv_offload_cpu_stores_skipped_total"],
        "vllm:kv_offload_stores_skipped_total": ours["kv_offload_cpu_stores_skipped_total"]
        + ours.get("kv_offload_disk_stores_skipped_total", 0.0),
        "vllm:kv_offload_cpu_cache_read_usage_perc": read,
        "vllm:kv_offload_cpu_cache_write_usage_perc": write,
        "vllm:kv_offload_cpu_cache_usage_perc": read + write,
        # vLLM's SimpleCPUOffloadConnector's names for the same CPU tier: blocks held, loaded, stored or skipped;
        # a store completes within the engine step that starts it, so none is ever pending at a snapshot.
        "vllm:simple_kv_offload_used_blocks": float(used),
        "vllm:simple_kv_offload_pending_store_blocks": 0.0,
        "vllm:simple_kv_offload_load_blocks_total": ours["kv_offload_cpu_to_device_blocks_total"],
        'vllm:simple_kv_offload_save_outcomes_total{outcome="stored"}': ours["kv_offload_device_to_cpu_blocks_total"],
        'vllm:simple_kv_offload_save_outcomes_total{outcome="skipped"}': ours["kv_offload_cpu_stores_skipped_total"],
    }
