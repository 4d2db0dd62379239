"""EngineStats: one consistent snapshot of the engine's counters and gauges, taken on the engine thread.

Readers on other threads (/metrics on the HTTP event loop) use the last snapshot the engine thread published and
never touch the scheduler's or the pool's live tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    connector: dict[str, float] = field(default_factory=dict)
    integrity: str | None = None  # "ok" or "violated: ..." when the snapshot checked the invariants

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
