"""EngineStats: one consistent snapshot of the engine's counters and gauges, taken on the engine thread.

Readers on other threads (/metrics on the HTTP event loop) use the last snapshot the engine thread published and
never touch the scheduler's or the pool's live tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.kv.histogram import HistogramSnapshot

if TYPE_CHECKING:
    from hybridkv.connectors.base import KVConnector
    from hybridkv.engine.scheduler import Scheduler
    from hybridkv.kv.coordinator import KVCacheCoordinator


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    group_blocks_used: tuple[int, ...] = ()  # attention groups (the state group is counted below)
    state_blocks_used: int = 0  # block ids the state group's bundles hold (live states, hit checkpoints)
    state_checkpoint_bytes: int = 0  # bytes of state pages published as checkpoints (held or evictable)
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    external_hit_tokens: int = 0
    kv_load_failures: int = 0
    prompt_local_hit_tokens: int = 0  # prompt tokens found cached at first admission
    external_query_tokens: int = 0  # prompt tokens asked of a connector at first admission
    connector: dict[str, float] = field(default_factory=dict)
    connector_histograms: dict[str, HistogramSnapshot] = field(default_factory=dict)  # and the pool's residency
    kv_fetch_stages: dict[str, int] = field(default_factory=dict)  # requests loading KV, by stage
    integrity: str | None = None  # "ok" or "violated: ..." when the snapshot checked the invariants

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def snapshot(
    scheduler: Scheduler, kv: KVCacheCoordinator, connector: KVConnector | None, check_integrity: bool = False
) -> EngineStats:
    """The engine's `EngineStats` now (on the engine thread); with `check_integrity`, the KV core's invariants
    checked too."""
    s, pool, st, plan = scheduler, kv.pool, scheduler.stats, kv.plan
    held = kv.blocks_held_per_group()
    state = plan.state
    integrity = None
    if check_integrity:
        try:
            kv.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"violated: {e}"
    return EngineStats(
        running=len(s.running),
        waiting=len(s.waiting),
        waiting_for_kv=len(s.waiting_for_kv),
        blocks_used=pool.num_used_blocks,
        blocks_free=pool.num_free_blocks,
        group_blocks_used=tuple(n for g, n in zip(plan.groups, held) if not g.is_state),
        state_blocks_used=sum(n for g, n in zip(plan.groups, held) if g.is_state),
        state_checkpoint_bytes=0
        if state is None
        else sum(g == state.group for _, g in pool.cached) * state.bytes_per_request,
        prefix_query_tokens=st.prefix_query_tokens,
        prefix_hit_tokens=st.prefix_hit_tokens,
        prompt_tokens=st.prompt_tokens,
        generation_tokens=st.generation_tokens,
        preemptions=s.num_preemptions,
        external_hit_tokens=st.external_hit_tokens,
        kv_load_failures=st.kv_load_failures,
        prompt_local_hit_tokens=st.prompt_local_hit_tokens,
        external_query_tokens=st.external_query_tokens,
        connector=connector.metrics() if connector is not None else {},
        kv_fetch_stages=connector.fetch_stages() if connector is not None else {},
        connector_histograms=(connector.histograms() if connector is not None else {})
        | (pool.residency.snapshot() if pool.residency is not None else {}),
        integrity=integrity,
    )
