"""The exact chunking of recurrent-state plans: splits only at multiples of the unit, the last prompt token and
every later token alone, the prompt-end checkpoint, and what may be published."""

from __future__ import annotations

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
