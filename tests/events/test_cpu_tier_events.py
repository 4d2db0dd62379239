"""The CPU offload tier's KV events: stored when an entry becomes ready (with the metadata its caller gave),
removed when it is evicted, nothing for a pending entry that is discarded."""

from hybridkv.connectors.offload.cpu import CpuTier
from hybridkv.kv.events import BlockRemoved, BlockStored, KVEventLog


def tier(slots: int) -> CpuTier:
    t = CpuTier(slots * 64, 64)
    t.events = KVEventLog()
    return t


def test_ready_pending_and_evicted_entries():
    t = tier(2)
    t.allocate((b"a", 0), meta=(None, (1, 2), 2))
    t.allocate((b"b", 1), ready=False, meta=(b"a", (3, 4), 2))  # filled from disk: not yet visible
    assert t.events.drain() == [BlockStored((b"a",), None, (1, 2), 2, 0, "CPU")]
    t.commit((b"b", 1))
    assert t.events.drain() == [BlockStored((b"b",), b"a", (3, 4), 2, 1, "CPU")]
    t.allocate((b"c", 0))  # evicts the least recent ready entry
    assert t.events.drain() == [BlockRemoved((b"a",), 0, "CPU"), BlockStored((b"c",), None, (), 0, 0, "CPU")]
    t.allocate((b"d", 0), ready=False)  # evicts b; d never becomes visible
    t.discard((b"d", 0))
    assert t.events.drain() == [BlockRemoved((b"b",), 1, "CPU")]
    assert t.ready_keys() == [(b"c", 0)]


def test_no_log_no_records():
    t = CpuTier(128, 64)
    t.allocate((b"a", 0), meta=(None, (1,), 1))
    assert t.events is None and t.ready_keys() == [(b"a", 0)]
