"""A cumulative histogram a connector fills on its own threads and /metrics reads in the engine's snapshot: the
bucket bounds, the count of observations at or below each (the last is +Inf: every one), and their sum."""

from __future__ import annotations

import bisect
import threading

HistogramSnapshot = tuple[tuple[float, ...], tuple[int, ...], float]  # (bounds, cumulative counts, sum)
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES = tuple(float(1 << k) for k in range(10, 33, 2))  # 1 KiB .. 4 GiB, by 4x
COUNTS = tuple(float(1 << k) for k in range(0, 17))  # 1 .. 65536


class CumulativeHistogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, running = [], 0
            for n in self._counts:
                running += n
                counts.append(running)
            return self.bounds, tuple(counts), self._sum
