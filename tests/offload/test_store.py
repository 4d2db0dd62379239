"""The tiered store's verbs on their own: which block a request resumes at from the tiers (the window rule of the
device prefix cache), what a store skips, what a load pins and what it leaves in the CPU tier."""

from __future__ import annotations

import hashlib

import torch

from hybridkv.connectors.offload.cpu import CpuTier
from hybridkv.connectors.offload.disk import DiskTier
from hybridkv.connectors.offload.stats import OffloadStats
from hybridkv.connectors.offload.store import LoadItem, TieredStore
from hybridkv.kv.spec import FullAttentionSpec, SlidingWindowSpec

BS = 4
FULL = FullAttentionSpec(num_kv_heads=1, head_size=4, dtype=torch.float32, block_size=BS)
SLIDING = SlidingWindowSpec(num_kv_heads=1, head_size=4, dtype=torch.float32, block_size=BS, sliding_window=5)
HASHES = [hashlib.sha256(str(i).encode()).digest() for i in range(12)]
COMPAT = hashlib.sha256(b"model").hexdigest()


class Copier:
    def payload_bytes(self, group: int) -> int:
        return 64


def store(specs=(FULL, SLIDING), slots: int = 64, disk: DiskTier | None = None) -> TieredStore:
    cpu = CpuTier(slots * 64, 64)
    return TieredStore(cpu, disk, specs, Copier(), OffloadStats())  # type: ignore[arg-type]


def put(s: TieredStore, blocks, group: int) -> None:
    for i in blocks:
        assert s.prepare_store((HASHES[i], group)) is not None


def test_a_sliding_group_needs_only_the_window_before_the_resume_point():
    s = store(specs=(SLIDING,))
    put(s, [0, 5, 6], 0)
    # Window 5, block size 4: the token at 4k reads tokens [4k - 4, 4k], so resuming at block k needs block k - 1
    # only. Resuming at 7 needs block 6: 7 is the answer although blocks 1-4 are gone.
    assert s.lookup(HASHES, 0, 7) == 7
    assert s.lookup(HASHES, 0, 5) == 1  # at 5 block 4 is missing; the longest run from the start is block 0
    assert s.lookup(HASHES, 2, 5) == 2  # nothing from 2 on that block 4's window does not need


def test_every_group_agrees_on_one_resume_block():
    s = store()
    put(s, range(7), 0)  # full attention holds blocks 0-6
    put(s, [0, 1, 2, 3, 5], 1)  # sliding misses block 4 and 6
    assert s.lookup(HASHES, 0, 7) == 6  # 7 needs sliding block 6; 6 needs block 5 only
    put(s, [6], 1)
    assert s.lookup(HASHES, 0, 7) == 7


def test_a_store_skips_what_a_tier_holds_and_counts_what_finds_no_slot():
    s = store(slots=2)
    put(s, [0], 0)
    assert s.prepare_store((HASHES[0], 0)) is None  # held: nothing to copy
    s.cpu.pin((HASHES[0], 0))
    put(s, [1], 0)
    s.cpu.pin((HASHES[1], 0))
    assert s.prepare_store((HASHES[2], 0)) is None  # both slots pinned
    assert s.stats.snapshot()["kv_offload_cpu_stores_skipped_total"] == 1


def test_a_load_pins_cpu_entries_and_a_verified_disk_entry_stays_in_the_cpu_tier(tmp_path):
    disk = DiskTier(tmp_path, COMPAT, 1 << 20, entry_bytes=64)
    s = store(disk=disk)
    on_disk = (HASHES[3], 0)
    assert disk.write(on_disk, memoryview(bytes(64)))
    in_cpu = (HASHES[1], 0)
    s.complete_store([(in_cpu, s.prepare_store(in_cpu))])  # pinned for its disk write until the writer is done
    s.flush()
    assert disk.contains(in_cpu)
    items = [LoadItem(0, 5, in_cpu), LoadItem(0, 6, on_disk)]
    assert s.prepare_load(items) is None
    assert not items[0].from_disk and items[1].from_disk and items[1].slot is not None
    assert not s.cpu.contains(on_disk)  # pending until verified
    items[1].filled = True
    s.complete_load(items)
    assert s.cpu.contains(on_disk)
    s.check_integrity()
    missing = [LoadItem(0, 7, (HASHES[9], 0))]
    assert "left the offload tiers" in (s.prepare_load(missing) or "")
    s.complete_load(missing)
    s.shutdown()
