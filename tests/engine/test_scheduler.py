"""Scheduler behaviour with a scripted 'model': every sampled token is 7, EOS is 1."""

import pytest

from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
from hybridkv.kv.coordinator import KVCacheCoordinator
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus
from tests.engine.sched_util import schedule, update
from tests.kv.util import P, model, plan


def make(blocks: int = 64, budget: int = 64, max_len: int = 128, seqs: int = 8) -> Scheduler:
    p = plan(model("FS"), P * blocks, max_model_len=max_len, max_num_batched_tokens=budget)
    return Scheduler(KVCacheCoordinator(p), SchedulerConfig(budget, seqs, max_len))


def req(rid: str, n: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **kw), 16, (1,))


def run(s: Scheduler, token: int = 7, steps: int = 200) -> list[tuple[int, list]]:
    trace = []
    for _ in range(steps):
        if not s.has_unfinished():
            break
        out = schedule(s)
        trace.append((out.num_tokens, out.preempted))
        update(s, out, {c.request_id: token for c in out.chunks if c.sample})
        s.kv.check_integrity()
    assert not s.has_unfinished()
    assert s.kv.pool.num_used_blocks == 0
    return trace


def test_chunked_prefill_respects_the_token_budget():
    s = make(budget=32)
    s.add(req("a", 70, max_tokens=2))
    trace = run(s)
    assert [n for n, _ in trace] == [32, 32, 6, 1]


def test_continuous_batching_admits_while_others_decode():
    s = make(budget=64)
    s.add(req("a", 10, max_tokens=3))
    out = schedule(s)
    update(s, out, {"a": 7})
    s.add(req("b", 20, max_tokens=3))
    out = schedule(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 20)]
    update(s, out, {"a": 7, "b": 7})
    run(s)


def test_eos_respects_min_tokens_and_ignore_eos():
    s = make()
    a, b = req("a", 5, max_tokens=5), req("b", 5, max_tokens=5, ignore_eos=True)
    s.add(a)
    s.add(b)
    run(s, token=1)
    assert a.output_token_ids == [1] and a.status is RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == [1] * 5 and b.status is RequestStatus.FINISHED_LENGTH


def test_preemption_frees_and_recomputes():
    # 11 usable blocks; each request needs up to 4 full + 3 sliding blocks: two cannot decode to 60 tokens.
    s = make(blocks=12, budget=64, max_len=64)
    a, b = req("a", 30, max_tokens=30), req("b", 30, max_tokens=30)
    s.add(a)
    s.add(b)
    trace = run(s)
    assert any(p for _, p in trace) and s.num_preemptions >= 1 and b.num_preemptions >= 1
    assert len(a.output_token_ids) == 30 and len(b.output_token_ids) == 30


def test_abort_frees_blocks_at_any_point():
    s = make()
    s.add(req("a", 40, max_tokens=50))
    s.add(req("b", 40, max_tokens=50))
    out = schedule(s)
    update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert s.kv.pool.num_used_blocks > 0
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("b", RequestStatus.FINISHED_ABORTED)
    s.finish("missing", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.pool.num_used_blocks == 0
    s.kv.check_integrity()


def test_prefix_cache_is_reused_by_a_later_request():
    s = make()
    s.add(req("a", 50, max_tokens=1))
    run(s)
    s.add(req("b", 50, max_tokens=1))
    out = schedule(s)
    assert out.chunks[0].start == 48 and len(out.chunks[0].token_ids) == 2


def test_bad_requests_are_rejected_and_lose_nothing():
    s = make(max_len=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        s.add(req("long", 64))
    s.add(req("a", 10))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("a", 10))
    run(s)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"min_tokens": 9, "max_tokens": 2},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
    ],
)
def test_sampling_params_validation(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_preemption_picks_the_newest_request_never_one_scheduled_this_step():
    """Blocks run out while decoding three requests: each victim is the most recently admitted running request, and
    no request both runs a chunk and is preempted in one step (its freed blocks would be written by that chunk)."""
    s = make(blocks=16, budget=64, max_len=64)
    reqs = [req(r, 20, max_tokens=40) for r in "abc"]
    for r in reqs:
        s.add(r)
    victims = 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        before = [r.request_id for r in s.running]
        out = schedule(s)
        ran = {c.request_id for c in out.chunks}
        assert not ran & set(out.preempted), (ran, out.preempted)
        if out.preempted:  # popped newest first, from the running list as it stood
            assert out.preempted == before[::-1][: len(out.preempted)], (before, out.preempted)
            victims += len(out.preempted)
        update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
        s.kv.check_integrity()
    assert not s.has_unfinished() and victims >= 2
    assert [len(r.output_token_ids) for r in reqs] == [40, 40, 40]
    assert reqs[0].num_preemptions == 0  # the oldest always runs on


def test_prefix_cache_queries_count_every_admission_with_its_tokens_then():
    """A request readmitted after a preemption queries the prefix cache again, for all its tokens at that time
    (prompt and the outputs it recomputes), as vLLM counts; its prompt counts once in prompt_tokens."""
    s = make(blocks=12, budget=64, max_len=64)
    reqs = [req("a", 30, max_tokens=30), req("b", 30, max_tokens=30)]
    for r in reqs:
        s.add(r)
    queried, readmitted_with_outputs = 0, 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        waiting = {r.request_id: (r.num_tokens, len(r.output_token_ids)) for r in s.waiting}
        out = schedule(s)
        for r in s.running:
            if r.request_id in waiting:
                n, outputs = waiting[r.request_id]
                queried += n
                readmitted_with_outputs += outputs > 0
        update(s, out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert not s.has_unfinished() and readmitted_with_outputs >= 1 and s.num_preemptions >= 1
    assert s.stats.prefix_query_tokens == queried > 60
    assert s.stats.prompt_tokens == 60 and s.stats.prefix_hit_tokens <= queried
