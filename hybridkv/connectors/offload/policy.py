"""Eviction policies for the offload tiers: which resident entry goes when a tier is full.

A policy tracks keys only (no bytes, no slots) and is driven under its tier's lock: `insert` a key that became
resident, `touch` one that was used, `remove` one that was dropped for another reason (corrupt, discarded), and
`evict` to pick and forget a victim among the entries `evictable` allows (pinned entries are never victims).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

EVICTION_POLICIES = ("lru", "arc")


class EvictionPolicy:
    def insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def evict(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        """Forget and return the victim, or None when every resident entry is protected."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


def _first(entries: OrderedDict, evictable: Callable[[Hashable], bool]) -> Hashable | None:
    """The least recently used evictable key of `entries` (oldest first)."""
    return next((k for k in entries if evictable(k)), None)


class LRUPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def insert(self, key: Hashable) -> None:
        self._entries[key] = None
        self._entries.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def evict(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        key = _first(self._entries, evictable)
        if key is not None:
            del self._entries[key]
        return key

    def __len__(self) -> int:
        return len(self._entries)


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement: T1 holds keys seen once, T2 keys used again; ghost lists B1/B2 remember recent
    victims of each. A miss that hits a ghost moves the target size `p` of T1 toward the list that would have
    kept it. Invariants: T1, T2 hold exactly the resident keys; each ghost list holds at most `capacity` keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0  # target number of resident keys in T1
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
        elif key in self.b1:  # recency would have kept it: grow T1's target
            self.p = min(self.capacity, self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # frequency would have kept it: shrink T1's target
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        for entries in (self.t1, self.t2):
            entries.pop(key, None)

    def evict(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        lists = [(self.t1, self.b1), (self.t2, self.b2)]
        if not (self.t1 and len(self.t1) > self.p):
            lists.reverse()
        for resident, ghost in lists:
            key = _first(resident, evictable)
            if key is not None:
                del resident[key]
                ghost[key] = None
                while len(ghost) > self.capacity:
                    ghost.popitem(last=False)
                return key
        return None

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """`capacity`: entries the tier holds when full (ARC sizes its ghost lists from it)."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")
