"""OffloadingConnector's hit and miss counters count requests, not lookups: a request that waits for blocks is
looked up again at every step, and must still count once. No model: the scheduler runs a scripted one over a
real KV memory, so the copies move zeros."""

from __future__ import annotations

from hybridkv.connectors.base import EngineIdentity, KVTransferConfig
from hybridkv.connectors.offload.connector import OffloadingConnector
from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus
from tests.engine.sched_util import schedule, update
from tests.kv.util import BS, model, plan

NUM_REQUESTS = 8
PROMPT = 40  # tokens: 2 full blocks to store and load per group, and the last token computed


def setup(blocks: int, cpu_slots: int = 256, caching: bool = True) -> tuple[Scheduler, OffloadingConnector, list[int]]:
    """A pool of `blocks` blocks (one full and one sliding group, window 32) and a CPU tier of `cpu_slots` blocks
    (by default far larger than the working set). Returns the scheduler, its connector and the lookups made."""
    stride = plan(model("FS"), 100 * 2 * 4096).bytes_per_block
    p = plan(model("FS"), stride * blocks, max_model_len=64, max_num_batched_tokens=16)
    assert p.num_blocks == blocks
    config = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_bytes": cpu_slots * 4096})
    connector = OffloadingConnector(config, EngineIdentity("test", "fingerprint", "float32"))
    connector.register(p, KVCacheMemory(p))
    lookups = [0]
    lookup = connector.num_external_tokens

    def counted(req: Request, num_local_tokens: int) -> int:
        lookups[0] += 1
        return lookup(req, num_local_tokens)

    connector.num_external_tokens = counted  # type: ignore[method-assign]
    s = Scheduler(KVCacheCoordinator(p, enable_prefix_caching=caching), SchedulerConfig(64, 8, 64), connector)
    return s, connector, lookups


def run_batch(s: Scheduler) -> None:
    for i in range(NUM_REQUESTS):
        tokens = [1000 * i + j for j in range(PROMPT)]
        s.add(Request(f"r{len(s.requests)}-{i}", tokens, SamplingParams(max_tokens=2), BS, ()))
    for _ in range(500):
        if not (s.has_unfinished() or s.connector.has_pending()):
            break
        out = schedule(s)
        if out.is_empty:
            s.connector.wait(1.0)  # loads run on the loader thread
        update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert not s.has_unfinished() and s.kv.pool.num_used_blocks == 0
    assert s.num_preemptions == 0  # every request loads at most once
    s.kv.check_integrity()


def test_hits_and_misses_count_each_request_once():
    # 13 usable blocks: a request holds 3 + 3 at most, so two run at once and the others wait, looked up again.
    s, connector, lookups = setup(blocks=14)
    run_batch(s)
    m = connector.metrics()
    assert lookups[0] > NUM_REQUESTS  # waiting requests were looked up at several steps
    assert m["kv_offload_misses_total"] == NUM_REQUESTS and m["kv_offload_hits_total"] == 0
    s.kv.pool.reset_prefix_cache()  # the device forgets: every prompt loads from the CPU tier
    before = lookups[0]
    run_batch(s)
    m = connector.metrics()
    assert lookups[0] - before > NUM_REQUESTS
    assert m["kv_offload_misses_total"] == NUM_REQUESTS and m["kv_offload_hits_total"] == NUM_REQUESTS
    assert s.stats.external_hit_tokens == NUM_REQUESTS * 2 * BS
    assert not connector.looked_up and not connector.stored  # nothing kept for finished requests
    connector.check_integrity()
    connector.shutdown()


def test_a_request_aborted_before_it_ran_counts_nothing_and_is_forgotten():
    s, connector, _ = setup(blocks=14)
    run_batch(s)  # 8 misses, every prompt stored
    s.kv.pool.reset_prefix_cache()
    for i in range(3):
        s.add(Request(f"a{i}", [1000 * i + j for j in range(PROMPT)], SamplingParams(max_tokens=2), BS, ()))
    s.add(Request("new", list(range(90000, 90000 + PROMPT)), SamplingParams(max_tokens=2), BS, ()))
    schedule(s)  # a0 and a1 start loading; a2 is looked up and waits for blocks
    assert set(s.waiting_for_kv) == {"a0", "a1"} and "a2" in connector.looked_up
    for rid in ("a0", "a2"):
        s.finish(rid, RequestStatus.FINISHED_ABORTED)
    assert "a0" not in connector.looked_up and "a2" not in connector.looked_up
    while s.has_unfinished() or connector.has_pending():
        out = schedule(s)
        if out.is_empty:
            connector.wait(1.0)
        update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    m = connector.metrics()
    assert m["kv_offload_hits_total"] == 2 and m["kv_offload_misses_total"] == NUM_REQUESTS + 1  # a0, a1; new
    assert not connector.looked_up and not connector.stored and s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()
    connector.shutdown()


def test_a_preempted_request_that_misses_again_counts_one_miss():
    # 11 usable blocks: two requests cannot both decode to 60 tokens, so one is preempted and recomputed. With
    # no device prefix cache the readmission looks the prompt up in the tiers again; a CPU tier of one slot
    # never holds both groups' first block, so every lookup misses.
    s, connector, lookups = setup(blocks=12, cpu_slots=1, caching=False)
    for i in range(2):
        s.add(Request(f"p{i}", [1000 * i + j for j in range(30)], SamplingParams(max_tokens=30), BS, ()))
    while s.has_unfinished():
        out = schedule(s)
        update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert s.num_preemptions >= 1 and s.kv.pool.num_used_blocks == 0
    m = connector.metrics()
    assert lookups[0] > 2 and m["kv_offload_misses_total"] == 2 and m["kv_offload_hits_total"] == 0
    assert not connector.looked_up and not connector.stored
    connector.shutdown()


def test_a_request_that_loads_twice_counts_one_hit():
    """A failed load is retried (the request goes back to the queue and finds its blocks in the tier again):
    still one hit for the request, not one per load."""
    s, connector, _ = setup(blocks=14)
    run_batch(s)
    s.kv.pool.reset_prefix_cache()
    fail_once = {"left": NUM_REQUESTS}
    run_load = connector.loader._run

    def flaky(load):  # each request's first load fails (a corrupt entry, say); its retry succeeds
        if fail_once["left"] and not load.request_id.endswith("-retried"):
            fail_once["left"] -= 1
            load.error = "a corrupt entry"
            return None
        return run_load(load)

    connector.loader._run = flaky
    before = connector.metrics()
    run_batch(s)
    m = connector.metrics()
    assert m["kv_offload_hits_total"] - before["kv_offload_hits_total"] == NUM_REQUESTS
    assert s.stats.kv_load_failures == NUM_REQUESTS
    connector.shutdown()
