"""Prometheus text exposition for the engine: the engine thread's last EngineStats snapshot, and the latency
histograms kept here."""

from __future__ import annotations

from bisect import bisect_left

from hybridkv.engine.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [f"# TYPE {name} histogram"], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {total}"]


class EngineMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram()
        self.itl = Histogram()

    def render(self, stats: EngineStats) -> str:
        """The Prometheus text of a snapshot the engine thread published, and of the latency histograms."""
        lines = [
            "# TYPE hybridkv_requests_running gauge",
            f"hybridkv_requests_running {stats.running}",
            "# TYPE hybridkv_requests_waiting gauge",
            f"hybridkv_requests_waiting {stats.waiting}",
            "# TYPE hybridkv_requests_waiting_for_kv gauge",
            f"hybridkv_requests_waiting_for_kv {stats.waiting_for_kv}",
            "# TYPE hybridkv_kv_blocks_used gauge",
            f"hybridkv_kv_blocks_used {stats.blocks_used}",
            "# TYPE hybridkv_kv_blocks_free gauge",
            f"hybridkv_kv_blocks_free {stats.blocks_free}",
            "# TYPE hybridkv_kv_group_blocks_used gauge",
            *(f'hybridkv_kv_group_blocks_used{{group="{g}"}} {n}' for g, n in enumerate(stats.group_blocks_used)),
            "# TYPE hybridkv_kv_state_blocks_used gauge",
            f"hybridkv_kv_state_blocks_used {stats.state_blocks_used}",
            "# TYPE hybridkv_kv_state_checkpoint_bytes gauge",
            f"hybridkv_kv_state_checkpoint_bytes {stats.state_checkpoint_bytes}",
            "# TYPE hybridkv_prefix_cache_hit_rate gauge",
            f"hybridkv_prefix_cache_hit_rate {stats.prefix_cache_hit_rate}",
            "# TYPE hybridkv_prefix_cache_queries_total counter",
            f"hybridkv_prefix_cache_queries_total {stats.prefix_query_tokens}",
            "# TYPE hybridkv_prefix_cache_hits_total counter",
            f"hybridkv_prefix_cache_hits_total {stats.prefix_hit_tokens}",
            "# TYPE hybridkv_prompt_tokens_total counter",
            f"hybridkv_prompt_tokens_total {stats.prompt_tokens}",
            "# TYPE hybridkv_generation_tokens_total counter",
            f"hybridkv_generation_tokens_total {stats.generation_tokens}",
            "# TYPE hybridkv_preemptions_total counter",
            f"hybridkv_preemptions_total {stats.preemptions}",
            "# TYPE hybridkv_external_hit_tokens_total counter",
            f"hybridkv_external_hit_tokens_total {stats.external_hit_tokens}",
            "# TYPE hybridkv_kv_load_failures_total counter",
            f"hybridkv_kv_load_failures_total {stats.kv_load_failures}",
            *(f"hybridkv_{k} {v}" for k, v in stats.connector.items()),
            *self.ttft.lines("hybridkv_time_to_first_token_seconds"),
            *self.itl.lines("hybridkv_inter_token_latency_seconds"),
        ]
        return "\n".join(lines) + "\n"
