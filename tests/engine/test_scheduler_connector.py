"""The scheduler with a scripted connector: what a load, a failed load, a preemption or a finish leaves held.

The 'model' samples token 7 every step. Window 32 (or 16), block 16, one full and one sliding group."""

from __future__ import annotations

import pytest

from hybridkv.connectors.base import ConnectorEvents, KVConnector
from hybridkv.connectors.pd.descriptors import block_moves
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.spec import cdiv
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request
from tests.engine.sched_util import schedule, update
from tests.kv.util import BS, full, plan, sliding


class FakeConnector(KVConnector):
    """Can load, for the request ids in `loadable`, every whole block up to that many tokens (one load per
    request). Loads finish at the next poll when `auto`, else when the test calls `finish_load`. Finished requests
    are held (a lease) when `hold`, until `release`."""

    def __init__(self, auto: bool = True, hold: bool = False, fail: bool = False) -> None:
        self.auto, self.hold, self.fail = auto, hold, fail
        self.loadable: dict[str, int] = {}
        self.loading: set[str] = set()
        self.leased: dict[str, list[list[int]]] = {}
        self.events = ConnectorEvents()

    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        end = min(self.loadable.get(req.request_id, 0), (req.num_tokens - 1) // BS * BS)
        return max(0, end - num_local_tokens)

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        del self.loadable[req.request_id]
        self.loading.add(req.request_id)

    def finish_load(self, rid: str, ok: bool) -> None:
        self.loading.discard(rid)
        self.events.loaded[rid] = ok

    def request_finished(self, req: Request, block_ids: list[list[int]]):
        if self.hold:
            self.leased[req.request_id] = block_ids
        return self.hold, None

    def release(self, rid: str) -> None:
        self.events.released.append(rid)

    def poll(self) -> ConnectorEvents:
        if self.auto:
            for rid in list(self.loading):
                self.finish_load(rid, not self.fail)
        events, self.events = self.events, ConnectorEvents()
        return events


def kv(window: int = 32, blocks: int = 64, max_len: int = 512) -> KVCacheCoordinator:
    """A pool of exactly `blocks` blocks for one full and one sliding layer."""
    m = ModelKV("test", (full(), sliding(window)), {})
    stride = plan(m, 100 * 2 * 4096).bytes_per_block
    p: KVPlan = plan(m, stride * blocks, max_model_len=max_len, max_num_batched_tokens=16)
    assert p.num_blocks == blocks
    return KVCacheCoordinator(p)


def scheduler(c: KVCacheCoordinator, connector: FakeConnector, seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(c, SchedulerConfig(budget, seqs, c.plan.max_model_len), connector)


def req(rid: str, n: int, max_tokens: int = 2, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), BS, (1,))


def step(s: Scheduler):
    out = schedule(s)
    update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    s.kv.check_integrity()
    return out


def drain(s: Scheduler, steps: int = 300) -> None:
    for _ in range(steps):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished() and s.kv.pool.num_used_blocks == 0


def sliding_held(s: Scheduler, rid: str) -> list[int]:
    return [b for b in s.kv.block_ids(rid)[1] if b != 0]


# ---- 1: a load past the window leaves the sliding group only the window's blocks ----------------------------
@pytest.mark.parametrize("loaded_to", [192, 64])
def test_a_load_past_the_hit_drops_the_hit_blocks_outside_the_window(loaded_to):
    c, conn = kv(), FakeConnector(auto=False)
    s = scheduler(c, conn)
    s.add(req("warm", 50, max_tokens=1))  # caches blocks 0-2 of both groups
    drain(s)
    b = req("b", 200)
    assert c.find_cached_prefix(b.block_hashes, 200).num_tokens == 48  # a device hit of 3 blocks
    conn.loadable["b"] = loaded_to  # the connector loads blocks [3, loaded_to / 16)
    s.add(b)
    step(s)
    assert "b" in s.waiting_for_kv and b.num_external_tokens == loaded_to - 48
    # Token `loaded_to` reads tokens [loaded_to - 31, loaded_to]: the sliding entries before `first` are unread.
    first = (loaded_to - 31) // BS  # 10 (the hit's blocks 1 and 2 are unread) or 2 (hit block 2 is read)
    sliding = cdiv(200, BS) - first
    assert c.blocks_held_per_group() == [13, sliding]  # while loading: the hit's unread blocks were not kept
    conn.finish_load("b", True)
    out = step(s)
    assert [(ch.request_id, ch.start) for ch in out.chunks] == [("b", loaded_to)]
    assert c.blocks_held_per_group() == [13, sliding]
    table = c.block_ids("b")[1]
    assert table[:first] == [0] * first and 0 not in table[first:]
    if loaded_to == 192:
        assert sliding == cdiv(32 - 1, BS) + 1  # the window: blocks 10, 11 and 12 (where token 192 goes)
    drain(s)


# ---- 2: each request's prompt is counted once ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["load ok", "load failed", "preempted", "preempted then loaded"])
def test_prompt_tokens_count_each_request_once(path):
    if path.startswith("preempted"):
        # 11 usable blocks; each request needs up to 4 full + 3 sliding blocks: two cannot decode to 60 tokens.
        c, conn = kv(blocks=12, max_len=64), FakeConnector()
        s = scheduler(c, conn)
        a, b = req("a", 30, max_tokens=30), req("b", 30, max_tokens=30, first=300)
        s.add(a)
        s.add(b)
        while not b.num_preemptions:
            step(s)
        if path == "preempted then loaded":
            c.pool.reset_prefix_cache()  # the device forgets b's blocks: it is readmitted through a load
            conn.loadable["b"] = 64
        drain(s)
        assert b.num_preemptions >= 1 and len(b.output_token_ids) == 30
        assert (s.stats.external_hit_tokens > 0) == (path == "preempted then loaded")
        assert s.stats.prompt_tokens == 60
        return
    c, conn = kv(), FakeConnector(fail=path == "load failed")
    s = scheduler(c, conn)
    conn.loadable["a"] = 64
    s.add(req("a", 70))
    drain(s)
    assert s.stats.kv_load_failures == (path == "load failed")
    assert s.stats.prompt_tokens == 70


# ---- 4: requests waiting for their KV count against max_num_seqs ---------------------------------------------
def test_requests_waiting_for_kv_count_against_max_num_seqs():
    c, conn = kv(), FakeConnector(auto=False)
    s = scheduler(c, conn, seqs=2)
    for i in range(4):
        conn.loadable[f"r{i}"] = 32
        s.add(req(f"r{i}", 40, first=100 * i))
    s.add(req("plain", 20, first=900))
    for _ in range(3):
        step(s)
        assert len(s.running) + len(s.waiting_for_kv) == 2
    assert set(s.waiting_for_kv) == {"r0", "r1"} and not s.running
    for rid in ("r0", "r1"):
        conn.finish_load(rid, True)
    step(s)
    assert {r.request_id for r in s.running} | set(s.waiting_for_kv) == {"r0", "r1"}
    conn.auto = True
    for _ in range(100):
        if not s.has_unfinished():
            break
        step(s)
        assert len(s.running) + len(s.waiting_for_kv) <= 2
    drain(s)


# ---- 5: a finished request leases only the sliding blocks its decoder reads ----------------------------------
@pytest.mark.parametrize("prompt_len", [160, 170, 175, 177])
def test_a_finished_request_leases_only_the_window_its_decoder_reads(prompt_len):
    window = 16
    prefill, conn = kv(window=window), FakeConnector(hold=True)
    s = scheduler(prefill, conn, budget=512)  # one chunk: the whole prompt's blocks were allocated at once
    s.add(req("p", prompt_len, max_tokens=1))
    step(s)
    leased = conn.leased["p"]
    # A decoder with nothing cached allocates the prompt with tokens [0, P-1) loaded, then reads them: it
    # computes token P-1, which reads tokens [P-W, P-1).
    decoder = kv(window=window)
    assert decoder.allocate("d", prompt_len, prompt_len - 1)
    moves = block_moves(decoder.block_ids("d"), leased, 0, prompt_len - 1, BS)  # raises if a block is gone
    num_blocks, first_read = cdiv(prompt_len, BS), (prompt_len - window) // BS
    assert len([m for m in moves if m[0] == 1]) == (prompt_len - 2) // BS - first_read + 1
    assert len(leased[0]) == num_blocks and 0 not in leased[0]  # full attention keeps every block
    assert leased[1][:first_read] == [0] * first_read and 0 not in leased[1][first_read:]
    assert len([b for b in leased[1] if b]) <= cdiv(window - 1, BS) + 1
    assert prefill.blocks_held_per_group() == [num_blocks, num_blocks - first_read]
    conn.release("p")
    step(s)
    assert prefill.pool.num_used_blocks == 0
    prefill.check_integrity()


def test_blocks_dropped_at_finish_stay_cached():
    """The sliding blocks dropped before `request_finished` are left cached like any freed block."""
    prefill, conn = kv(window=16), FakeConnector()
    s = scheduler(prefill, conn, budget=512)
    s.add(req("p", 100, max_tokens=1))
    drain(s)
    hashes = req("q", 100).block_hashes
    assert len(hashes) == 6 and all(prefill.pool.get_cached_block(h, g) for h in hashes for g in (0, 1))
    assert prefill.find_cached_prefix(hashes, 100).num_tokens == 96
