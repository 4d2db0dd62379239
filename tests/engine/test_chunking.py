"""The exact chunking of recurrent-state plans: splits only at multiples of the unit, the last prompt token and
every later token alone, the prompt-end checkpoint, and what may be published."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.engine.chunking import ExactChunks, FreeChunks
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request


def request(num_prompt: int, num_output: int = 0) -> Request:
    req = Request("r", list(range(4, 4 + num_prompt)), SamplingParams(max_tokens=8), 16)
    for t in range(num_output):
        req.append_token(t)
    return req


def schedule_all(policy: ExactChunks | FreeChunks, req: Request, budget: int, start: int = 0) -> list[tuple]:
    """The chunks [start, end) the policy runs until every known token is computed, with a fixed budget."""
    out = []
    while start < req.num_tokens:
        n = policy.chunk_len(req, start, budget)
        assert n > 0, f"stuck at {start}"
        out.append((start, start + n))
        start += n
    return out


def test_prompt_splits_at_the_unit_and_the_last_token_runs_alone():
    exact = ExactChunks(64)
    assert schedule_all(exact, request(150), 1000) == [(0, 128), (128, 149), (149, 150)]
    assert schedule_all(exact, request(150), 100) == [(0, 64), (64, 128), (128, 149), (149, 150)]
    assert schedule_all(exact, request(150), 64) == [(0, 64), (64, 128), (128, 149), (149, 150)]
    assert schedule_all(exact, request(129), 1000) == [(0, 128), (128, 129)]  # P1 on the unit: no tail
    assert schedule_all(exact, request(1), 1000) == [(0, 1)]
    assert schedule_all(exact, request(40), 1000) == [(0, 39), (39, 40)]


def test_chunk_end_policy_has_no_prompt_end_stop():
    assert schedule_all(ExactChunks(64, "chunk_end"), request(150), 1000) == [(0, 149), (149, 150)]


def test_generated_tokens_recomputed_after_a_preemption_run_one_at_a_time():
    chunks = schedule_all(ExactChunks(64), request(70, num_output=3), 1000)
    assert chunks == [(0, 64), (64, 69), (69, 70), (70, 71), (71, 72), (72, 73)]


def test_a_budget_below_the_unit_runs_nothing_until_the_last_token():
    exact = ExactChunks(64)
    assert exact.chunk_len(request(150), 0, 63) == 0
    assert exact.chunk_len(request(150), 128, 20) == 0  # the tail [128, 149) runs whole or not at all
    assert exact.chunk_len(request(150), 128, 21) == 21
    assert exact.chunk_len(request(150), 149, 1) == 1


def test_only_whole_units_of_the_prompt_are_published():
    exact = ExactChunks(64)
    assert exact.publishable(request(150), 150) == 128
    assert exact.publishable(request(150), 100) == 100
    assert exact.publishable(request(150, num_output=40), 190) == 128  # decode-path KV is never published
    assert ExactChunks(64, "none").publishable(request(150), 150) == 0
    assert FreeChunks().publishable(request(150), 150) == 150


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="state_checkpoints"):
        ExactChunks(64, "every_block")


def test_a_chunk_also_ends_at_the_branch_point_before_the_prompt_end():
    req = request(150)
    req.branch_tokens = 100  # the attention groups hold 100 tokens of cached history; no state checkpoint there
    assert schedule_all(ExactChunks(64), req, 1000) == [(0, 64), (64, 128), (128, 149), (149, 150)]
    assert schedule_all(ExactChunks(64, "chunk_end"), req, 1000) == [(0, 149), (149, 150)]


def test_the_smallest_next_chunk():
    exact = ExactChunks(64)
    req = request(150)
    assert exact.min_chunk(req) == 64
    req.num_computed_tokens = 128
    assert exact.min_chunk(req) == 21  # the tail to P1
    req.num_computed_tokens = 149
    assert exact.min_chunk(req) == 1
    assert FreeChunks().min_chunk(request(150)) == 1


def exact_scheduler(budget: int = 32):
    from hybridkv.engine.scheduler import Scheduler, SchedulerConfig
    from hybridkv.kv.coordinator import KVCacheCoordinator
    from hybridkv.kv.model_kv import ModelKV
    from tests.kv.test_state_manager import state
    from tests.kv.util import P, full, plan

    spec = dataclasses.replace(state(), chunk_size=32)
    p = plan(ModelKV("test", (full(), spec), {}), P * 64, max_model_len=256, max_num_batched_tokens=budget)
    assert p.state.align == 32
    return Scheduler(KVCacheCoordinator(p), SchedulerConfig(budget, 8, 256), chunking=ExactChunks(p.state.align))


def test_the_state_after_a_requests_last_token_is_not_stored():
    """The chunk whose token reaches max_tokens keeps the state as it was: a PD prefill (max_tokens 1) leaves the
    state before its last prompt token for the decoder; later tokens of a longer request store theirs."""
    from tests.engine.sched_util import schedule, update

    for max_tokens, keeps in ((1, [True, True, False]), (3, [True, True, True, True, False])):  # [0,32) [32,49) [49,50)
        s = exact_scheduler(2048)
        s.add(Request("r", list(range(4, 54)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 16))
        seen = []
        while s.has_unfinished():
            out = schedule(s)
            seen += [c.keep_state for c in out.chunks]
            update(s, out, {c.request_id: 1 for c in out.chunks if c.sample})
        assert seen == keeps, (max_tokens, seen)


def test_decodes_ahead_of_a_prefill_cannot_starve_it_at_a_budget_of_one_unit():
    """Budget 32 = the unit: request a decodes while b prefills behind it. Without a reserve, a's one token
    would leave 31 < 32 for b every step and b would never run."""
    from tests.engine.sched_util import schedule, update

    s = exact_scheduler(32)
    a = Request("a", list(range(4, 20)), SamplingParams(max_tokens=50, ignore_eos=True), 16)
    b = Request("b", list(range(4, 104)), SamplingParams(max_tokens=2, ignore_eos=True), 16)
    s.add(a)
    for _ in range(20):  # a: its prompt, then decodes
        update(s, schedule(s), {"a": 1})
    s.add(b)
    progress = []
    for _ in range(8):
        out = schedule(s)
        assert sum(len(c.token_ids) for c in out.chunks) <= 32
        update(s, out, {c.request_id: 1 for c in out.chunks if c.sample})
        progress.append(b.num_computed_tokens)
    assert progress[-1] > 64, progress  # b moves on although a decodes in every step it can
    s.kv.check_integrity()


def test_the_split_unit_of_batch_invariant_mode():
    """`exact_unit`: the exact tile rounded to blocks, the whole blocks a smaller budget holds, None where off; a
    hybrid's state align always; clear errors for a model without the mode and a budget below one block."""
    from types import SimpleNamespace

    from hybridkv.engine.chunking import exact_unit

    plan = SimpleNamespace(state=None, block_size=16)
    qwen3, gpt_oss = {"model_type": "qwen3"}, {"model_type": "gpt_oss"}
    assert exact_unit(None, "float32", 2048, qwen3, plan) == 64
    assert exact_unit(None, "float32", 100, qwen3, plan) == 64  # a budget past the unit keeps it
    assert exact_unit(None, "float32", 40, qwen3, plan) == 32
    assert exact_unit(None, "bfloat16", 2048, qwen3, plan) is None
    assert exact_unit(True, "bfloat16", 2048, qwen3, plan) == 64
    assert exact_unit(False, "float32", 2048, qwen3, plan) is None
    assert exact_unit(None, "float32", 2048, gpt_oss, plan) is None  # no such mode: the fast paths
    assert exact_unit(None, "float32", 2048, qwen3, SimpleNamespace(state=SimpleNamespace(align=128))) == 128
    assert exact_unit(None, "float32", 2048, qwen3, SimpleNamespace(state=None, block_size=48)) == 192  # lcm
    with pytest.raises(ValueError, match="no batch-invariant mode"):
        exact_unit(True, "float32", 2048, gpt_oss, plan)
    with pytest.raises(ValueError, match=r"below the block size 16.*--no-batch-invariant"):
        exact_unit(None, "float32", 8, qwen3, plan)
