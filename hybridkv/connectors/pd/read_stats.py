"""What a decoder's reads are counted by: our transfer counters (/admin/kv and /metrics as hybridkv_*) and vLLM's
NIXL series under their meanings here (failed transfers: reads that failed to start, failed, or timed out; the
histograms: time to post a read, time it took from submission to done, bytes and descriptors per read)."""

from __future__ import annotations

from hybridkv.connectors.base import FETCH_STAGES
from hybridkv.connectors.pd.protocol import LoadState
from hybridkv.kv.histogram import BYTES, COUNTS, SECONDS, CumulativeHistogram

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


# A load's state as vLLM's fetch stage: before the read (handshake, lease to confirm), reading, read (or failed:
# the request then computes the prompt) and waiting for the scheduler.
FETCH_STAGE = {LoadState.HANDSHAKE: "waiting_to_start", LoadState.CONFIRMING: "waiting_to_start",
               LoadState.READY: "waiting_to_start", LoadState.READING: "in_progress",
               LoadState.RELEASING: "completed_waiting", LoadState.FAILED: "completed_waiting"}  # fmt: skip


def fetch_stages(states: list[LoadState]) -> dict[str, int]:
    stages = [FETCH_STAGE[state] for state in states]
    return {stage: stages.count(stage) for stage in FETCH_STAGES}
