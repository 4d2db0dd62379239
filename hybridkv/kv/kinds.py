"""The one table of cache kinds: each kind's spec class (what a layer of that kind needs from the KV cache) and
its manager class (how a group of such layers holds blocks). The config reader, planner and coordinator look
kinds up here or ask the spec; a new kind is a new entry, with no branch anywhere else."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.kv.managers import GroupManager
from hybridkv.kv.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec
from hybridkv.kv.state import RecurrentStateSpec
from hybridkv.kv.state_manager import StateManager


@dataclass(frozen=True)
class CacheKind:
    """A cache kind: `name` is its spec's `kind` (also `KVGroup.kind`, `LayerAttn.kind`, `LayerState.kind`)."""

    name: str
    spec: type[KVSpec]
    manager: type[GroupManager]

    def __post_init__(self) -> None:
        if self.spec.kind != self.name:
            raise ValueError(f"cache kind {self.name!r} has a spec of kind {self.spec.kind!r}: they must agree")


CACHE_KINDS: dict[str, CacheKind] = {}
"""Kind name -> its entry. Filled by `register_cache_kind`; names are unique."""


def register_cache_kind(kind: CacheKind) -> CacheKind:
    """Add `kind` to the table and return it. A name already taken is a ValueError."""
    if kind.name in CACHE_KINDS:
        raise ValueError(f"cache kind {kind.name!r} is already registered (by {CACHE_KINDS[kind.name]})")
    CACHE_KINDS[kind.name] = kind
    return kind


def cache_kind(name: str) -> CacheKind:
    """The entry for kind `name`; an unknown name is a ValueError naming the registered ones."""
    if name not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {name!r}; registered: {', '.join(CACHE_KINDS)}")
    return CACHE_KINDS[name]


def manager_for(spec: KVSpec) -> type[GroupManager]:
    """The manager class for groups of `spec`'s kind."""
    return cache_kind(spec.kind).manager


register_cache_kind(CacheKind("full_attention", FullAttentionSpec, GroupManager))
register_cache_kind(CacheKind("sliding_window", SlidingWindowSpec, GroupManager))
register_cache_kind(CacheKind("recurrent_state", RecurrentStateSpec, StateManager))
