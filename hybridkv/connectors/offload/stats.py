"""OffloadStats: the OffloadingConnector's counters, written from the engine thread and its I/O threads.

Per direction (device_to_cpu, cpu_to_device, cpu_to_disk, disk_to_cpu): bytes, seconds, blocks and copies (one per
contiguous span moved); plus lookups that hit or missed, blocks served by each tier, failed loads and stores
skipped for want of a free CPU slot. Names are /metrics names without the hybridkv_ prefix.
"""

from __future__ import annotations

import threading
from collections import defaultdict

DIRECTIONS = ("device_to_cpu", "cpu_to_device", "cpu_to_disk", "disk_to_cpu")
COUNTERS = ("hits", "misses", "cpu_hit_blocks", "disk_hit_blocks", "load_failures", "cpu_stores_skipped")


class OffloadStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
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

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
