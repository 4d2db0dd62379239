"""The offload tiers on their own: eviction policies, CPU slots and pins, disk entries (atomic, checked, kept
across restarts, isolated by compatibility hash, skipped when the disk is full)."""

from __future__ import annotations

import errno
import hashlib
import logging

import pytest
import torch

from hybridkv.connectors.offload import disk as offload_disk
from hybridkv.connectors.offload.cpu import CpuTier
from hybridkv.connectors.offload.disk import HEADER, DiskTier
from hybridkv.connectors.offload.policy import ARCPolicy, LRUPolicy, make_policy

COMPAT = hashlib.sha256(b"model-a").hexdigest()
OTHER = hashlib.sha256(b"model-b").hexdigest()


def key(i: int, group: int = 0) -> tuple[bytes, int]:
    return hashlib.sha256(str(i).encode()).digest(), group


def payload(i: int, n: int = 64) -> memoryview:
    return memoryview(bytes((i + j) % 256 for j in range(n)))


# ---- policies ----------------------------------------------------------------------------------------------
def test_lru_evicts_least_recently_used_and_skips_protected():
    lru = LRUPolicy()
    for k in "abc":
        lru.insert(k)
    lru.touch("a")  # order: b, c, a
    assert lru.evict(lambda k: k != "b") == "c"
    assert lru.evict(lambda k: True) == "b"
    assert lru.evict(lambda k: False) is None and len(lru) == 1


def simulate(policy, accesses: list[str], capacity: int) -> set[str]:
    """Run an access trace through a tier of `capacity` entries; returns what stays resident."""
    resident: set[str] = set()
    for k in accesses:
        if k in resident:
            policy.touch(k)
            continue
        if len(resident) == capacity:
            resident.discard(policy.evict(lambda _: True))
        policy.insert(k)
        resident.add(k)
    return resident


def test_arc_keeps_reused_keys_through_a_scan_where_lru_loses_them():
    trace = ["hot1", "hot2", "hot1", "hot2", *(f"cold{i}" for i in range(20))]  # reuse, then a one-pass scan
    assert {"hot1", "hot2"} <= simulate(ARCPolicy(capacity=4), trace, 4)
    assert not {"hot1", "hot2"} & simulate(LRUPolicy(), trace, 4)


def test_arc_ghost_hit_adapts_and_remove_forgets():
    arc = ARCPolicy(capacity=2)
    arc.insert("a")
    arc.insert("b")
    assert arc.evict(lambda _: True) == "a"  # T1 is over its target (0): a goes to ghost list B1
    arc.insert("a")  # a ghost hit: recency would have kept it, T1's target grows
    assert arc.p > 0 and "a" in arc.t2
    arc.remove("a")
    assert len(arc) == 1


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="eviction must be one of lru, arc"):
        make_policy("fifo", 4)


# ---- CPU tier ----------------------------------------------------------------------------------------------
def test_cpu_tier_evicts_lru_and_never_a_pinned_entry():
    tier = CpuTier(capacity_bytes=3 * 16, slot_bytes=16)
    slots = [tier.allocate(key(i)) for i in range(3)]
    assert sorted(slots) == [0, 1, 2] and tier.allocate(key(0)) is None  # present already
    assert tier.pin(key(0)) == slots[0]  # pinning also counts as a use
    tier.allocate(key(3))  # full: evicts key 1, the least recently used unpinned entry
    assert not tier.contains(key(1)) and tier.contains(key(0)) and tier.evictions == 1
    tier.pin(key(2))
    tier.pin(key(3))
    assert tier.allocate(key(4)) is None  # every slot pinned: the store is skipped, nothing is lost
    for k in (0, 2, 3):
        tier.unpin(key(k))
    tier.check_integrity()


def test_cpu_tier_pending_entries_are_invisible_until_committed():
    tier = CpuTier(capacity_bytes=2 * 16, slot_bytes=16)
    slot = tier.allocate(key(0), ready=False)
    assert slot is not None and not tier.contains(key(0)) and tier.pin(key(0)) is None
    tier.commit(key(0))
    assert tier.contains(key(0))
    tier.allocate(key(1), ready=False)
    tier.discard(key(1))  # its fill failed
    assert not tier.contains(key(1)) and len(tier) == 1
    tier.check_integrity()


def test_cpu_tier_smaller_than_a_block_is_a_clear_error():
    with pytest.raises(ValueError, match="raise cpu_bytes"):
        CpuTier(capacity_bytes=100, slot_bytes=4096)


# ---- disk tier ---------------------------------------------------------------------------------------------
def read(tier: DiskTier, k: tuple[bytes, int], n: int = 64) -> tuple[str, bytes]:
    out = bytearray(n)
    return tier.read(k, memoryview(out)), bytes(out)


def test_disk_entries_round_trip_and_survive_a_restart(tmp_path):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    for i in range(3):
        assert tier.write(key(i), payload(i))
    again = DiskTier(tmp_path, COMPAT, 1 << 20)
    assert len(again) == 3 and again.used_bytes == 3 * (HEADER.size + 64)
    assert read(again, key(1)) == ("ok", bytes(payload(1)))
    assert not DiskTier(tmp_path, OTHER, 1 << 20).contains(key(1))  # another model never sees them
    again.check_integrity()


def test_disk_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    seen = []
    real_replace = offload_disk.os.replace

    def spy(src, dst):
        seen.append((src, dst))
        assert (HEADER.size + 64) == src.stat().st_size  # the whole entry exists before it gets its name
        assert not dst.exists()
        real_replace(src, dst)

    monkeypatch.setattr(offload_disk.os, "replace", spy)
    tier.write(key(0), payload(0))
    ((src, dst),) = seen
    assert src.parent == dst.parent and src.name.endswith(".tmp") and not src.exists()
    assert [p.name for p in tier.dir.iterdir()] == [dst.name]


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong_key"])
def test_a_damaged_entry_is_dropped_and_counted_never_served(tmp_path, damage):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    tier.write(key(0), payload(0))
    tier.write(key(1), payload(1))
    path = tier._path(key(0))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[:-10]))
    else:  # a valid entry of another key under this key's name
        path.write_bytes(tier._path(key(1)).read_bytes())
    status, _ = read(tier, key(0))
    assert status == "corrupt" and tier.corrupt == 1
    assert not tier.contains(key(0)) and not path.exists()
    assert read(tier, key(1))[0] == "ok"
    tier.check_integrity()


def test_disk_tier_evicts_to_stay_within_capacity(tmp_path):
    entry = HEADER.size + 64
    tier = DiskTier(tmp_path, COMPAT, 3 * entry)
    for i in range(3):
        tier.write(key(i), payload(i))
    tier.touch(key(0))
    tier.write(key(3), payload(3))  # evicts key 1
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True] and tier.evictions == 1
    assert len(list(tier.dir.iterdir())) == 3
    assert not tier.write(key(9), payload(9, 4 * entry)) and tier.skipped == 1  # bigger than the tier
    assert DiskTier(tmp_path, COMPAT, 2 * entry).used_bytes == 2 * entry  # a smaller restart trims
    tier.check_integrity()


def test_a_full_disk_skips_the_store_with_one_warning(tmp_path, monkeypatch, caplog):
    tier = DiskTier(tmp_path, COMPAT, 1 << 20)

    class FullDisk:
        def __init__(self, path, mode):
            self.f = open(path, mode)  # noqa: SIM115

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(bytes(data)[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_disk, "open", FullDisk, raising=False)
    with caplog.at_level(logging.WARNING, logger="hybridkv.connectors.offload.disk"):
        assert not tier.write(key(0), payload(0))
        assert not tier.write(key(1), payload(1))
    assert tier.skipped == 2 and len(tier) == 0 and tier.used_bytes == 0
    assert list(tier.dir.iterdir()) == []  # the partial temporary files are gone
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.undo()
    assert tier.write(key(2), payload(2)) and read(tier, key(2))[0] == "ok"  # space came back: stores resume


def test_stale_temporary_files_are_cleaned_at_start(tmp_path):
    import os

    tier = DiskTier(tmp_path, COMPAT, 1 << 20)
    stale, fresh = tier.dir / ".x.kv.1.tmp", tier.dir / ".y.kv.2.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")  # another instance may be writing it right now
    os.utime(stale, (0, 0))
    DiskTier(tmp_path, COMPAT, 1 << 20)
    assert not stale.exists() and fresh.exists()


def test_cpu_slot_bytes_reach_disk_unchanged(tmp_path):
    tier = CpuTier(capacity_bytes=4 * 64, slot_bytes=64)
    slot = tier.allocate(key(0))
    tier.slot(slot).copy_(torch.arange(64, dtype=torch.uint8))
    disk = DiskTier(tmp_path, COMPAT, 1 << 20)
    disk.write(key(0), memoryview(tier.slot(slot).numpy()))
    assert read(disk, key(0)) == ("ok", bytes(range(64)))
