"""Hand-built specs for KV core tests.

P, the page of one default `F`/`S` layer, is 16 tokens * 2 (K, V) * 2 heads * 16 * 4 bytes = 4096 bytes.
"""

from __future__ import annotations

import torch

from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.planner import CacheConfig, plan_kv_cache
from hybridkv.kv.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec

BS = 16
P = 2 * BS * 2 * 16 * 4


def full(heads: int = 2, head: int = 16, bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=heads, head_size=head, dtype=torch.float32, block_size=bs)


def sliding(window: int = 32, heads: int = 2, head: int = 16, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        num_kv_heads=heads, head_size=head, dtype=torch.float32, block_size=bs, sliding_window=window
    )


def model(pattern: str, shared: dict[int, int] | None = None, **kw) -> ModelKV:
    """'FFSS' -> two full then two sliding layers; layers in `shared` get no spec."""
    shared = shared or {}
    make = {"F": full, "S": sliding}
    specs: list[KVSpec | None] = [None if i in shared else make[c](**kw) for i, c in enumerate(pattern)]
    return ModelKV("test", tuple(specs), shared)


def plan(m: ModelKV, memory: int, max_model_len: int = 256, **kw) -> KVPlan:
    return plan_kv_cache(m, CacheConfig(memory_bytes=memory, max_model_len=max_model_len, **kw))
