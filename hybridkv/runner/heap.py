"""Which large blocks the C library maps fresh and unmaps when freed, chosen per step by the step's size.

glibc serves a block below its mmap threshold from its heap, which it keeps, and maps larger ones, which fault in
page by page and go back to the OS when freed. Its own rule raises the threshold (up to 32 MiB) each time a mapped
block is freed. Neither fixed rule suits both kinds of step (AMD EPYC Zen 3, one thread):

    long prefill   float32 temporaries of up to 64 MiB per projection (Qwen3-0.6B's shape, 4k tokens): from
                   the heap they stay resident after the step (RSS 2508 MiB held; peak 2508), mapped they are
                   returned (1584 held; peak 2180)
    decode         the same few buffers every step (16 rows x 262144 logits: 16 MiB of float32): mapped they
                   fault in again every step, which cost Gemma-3-270M's batch of 16 5-16% of its tokens/s

So a step of LONG_STEP_TOKENS or more maps every block from LONG_STEP_THRESHOLD up, and a shorter step lets the
heap keep blocks up to SHORT_STEP_THRESHOLD. Blocks mapped under the first rule are still unmapped when freed
under the second. The heap keeps up to TRIM_THRESHOLD of free top (glibc's moving rule would have raised it to
that, or not, depending on the process's history before the first step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
LONG_STEP_TOKENS = 512
LONG_STEP_THRESHOLD = 4 << 20
SHORT_STEP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold
TRIM_THRESHOLD = 2 * SHORT_STEP_THRESHOLD  # free heap top kept: glibc's own rule, 2x the mmap threshold


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt`, or None where the C library has none (not glibc)."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None


class HeapPolicy:
    """Sets the mmap threshold before each step. The setting is the process's, not this object's: another
    engine in the process may have changed it since, so every step sets it again (two calls of ~1 us)."""

    def __init__(self, mallopt: Callable[[int, int], int] | None) -> None:
        self.mallopt = mallopt

    @classmethod
    def for_device(cls, device_type: str) -> HeapPolicy:
        """On a CPU the step's temporaries are host memory; elsewhere they are not, and the rule stays glibc's."""
        return cls(glibc_mallopt() if device_type == "cpu" else None)

    def before_step(self, tokens: int) -> None:
        if self.mallopt is None:
            return
        want = LONG_STEP_THRESHOLD if tokens >= LONG_STEP_TOKENS else SHORT_STEP_THRESHOLD
        if not (self.mallopt(M_MMAP_THRESHOLD, want) and self.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            self.mallopt = None  # refused: leave the C library's rule alone from here on
