"""Block residency, sampled (vLLM's --kv-cache-metrics): for a sampled share of the blocks that enter the prefix
cache, how long they stay (cached until evicted), how long they sat unused before eviction, and the gap between
two uses (a prefix hit is a use; caching is the first).

    cached -------- hit -------- hit ---------------- evicted
      |<-- reuse gap -->|<-- gap -->|<-- idle before evict -->|
      |<------------------------- lifetime ------------------>|
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from hybridkv.kv.histogram import CumulativeHistogram, HistogramSnapshot

RESIDENCY_SECONDS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0)


class ResidencySampler:
    """Called by the block pool (engine thread); histograms read by /metrics through the engine's snapshot."""

    def __init__(self, sample_rate: float, clock: Callable[[], float] = time.monotonic, seed: int = 0) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate}")
        self.sample_rate, self.clock, self._rng = sample_rate, clock, random.Random(seed)
        self._cached: dict[int, tuple[float, float]] = {}  # sampled block id -> (cached at, last used at)
        self.histograms = {
            "vllm:kv_block_lifetime_seconds": CumulativeHistogram(RESIDENCY_SECONDS),
            "vllm:kv_block_idle_before_evict_seconds": CumulativeHistogram(RESIDENCY_SECONDS),
            "vllm:kv_block_reuse_gap_seconds": CumulativeHistogram(RESIDENCY_SECONDS),
        }

    def cached(self, block_id: int) -> None:
        if self._rng.random() < self.sample_rate:
            now = self.clock()
            self._cached[block_id] = (now, now)

    def used(self, block_id: int) -> None:
        entry = self._cached.get(block_id)
        if entry is not None:
            now = self.clock()
            self.histograms["vllm:kv_block_reuse_gap_seconds"].observe(now - entry[1])
            self._cached[block_id] = (entry[0], now)

    def evicted(self, block_id: int) -> None:
        entry = self._cached.pop(block_id, None)
        if entry is not None:
            now = self.clock()
            self.histograms["vllm:kv_block_lifetime_seconds"].observe(now - entry[0])
            self.histograms["vllm:kv_block_idle_before_evict_seconds"].observe(now - entry[1])

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {name: h.snapshot() for name, h in self.histograms.items()}
