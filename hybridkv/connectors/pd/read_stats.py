"""What a decoder's reads are counted by: our transfer counters (/admin/kv and /metrics as hybridkv_*) and vLLM's
NIXL series under their meanings here (failed transfers: reads that failed to start, failed, or timed out; the
histograms: time to post a read, time it took from submission to done, bytes and descriptors per read)."""

from __future__ import annotations

from hybridkv.connectors.histogram import BYTES, COUNTS, SECONDS, CumulativeHistogram

COUNTERS = ("kv_transfer_reads_total", "kv_transfer_bytes_total", "kv_transfer_descriptors_total",
            "kv_transfer_blocks_total", "kv_transfer_seconds_total", "kv_transfer_failures_total",
            "vllm:nixl_num_failed_transfers_total")  # fmt: skip
HISTOGRAMS = {
    "vllm:nixl_post_time_seconds": SECONDS,
    "vllm:nixl_xfer_time_seconds": SECONDS,
    "vllm:nixl_bytes_transferred": BYTES,
    "vllm:nixl_num_descriptors": COUNTS,
}


def new_counters() -> dict[str, float]:
    return dict.fromkeys(COUNTERS, 0.0)


def new_histograms() -> dict[str, CumulativeHistogram]:
    return {name: CumulativeHistogram(bounds) for name, bounds in HISTOGRAMS.items()}
