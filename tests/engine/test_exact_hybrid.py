"""One answer in every mode, for recurrent-state hybrids (tiny random Qwen3.5 and Nemotron-H, float32): the logits
of every sampled step are bitwise equal to the request run alone with the whole prompt in one chunk, whether it
shares its steps with other requests, its prompt is chunked under any token budget, it resumes from a cached
prefix (a state checkpoint), it is preempted and recomputed, or the KV layout is per-layer or packed. Each test
that relies on a fast path also checks that the path ran (a hit, a preemption)."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hybridkv.native import native_enabled
from tests.hybrid_util import GREEDY, NEW_TOKENS, alone, assert_same_bits, engine, generate, prompts


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_a_batch_equals_each_request_alone(hybrid_checkpoint, hybrid_reference, layout):
    assert_same_bits(
        generate(engine(hybrid_checkpoint, kv_layout=layout, enable_prefix_caching=False), prompts()), hybrid_reference
    )


@pytest.mark.parametrize("budget", [64, 100, 192])
def test_chunked_prefill_under_any_budget_equals_one_chunk(hybrid_checkpoint, hybrid_reference, budget):
    llm = engine(hybrid_checkpoint, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert_same_bits(generate(llm, prompts()), hybrid_reference)


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_resuming_from_a_cached_state_checkpoint_equals_computing_it(hybrid_checkpoint, hybrid_reference, layout):
    llm = engine(hybrid_checkpoint, kv_layout=layout)
    ps = prompts()
    got = [generate(llm, [p])[0] for p in ps]  # one after another: later prompts hit earlier ones' checkpoints
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens >= 2 * 128, stats  # prompts 3 and 4 resumed at the checkpoint at 128 (or 96)
    assert_same_bits(got, hybrid_reference)


def test_preemption_and_recompute_equal_the_undisturbed_run(hybrid_checkpoint, hybrid_reference):
    plan = engine(hybrid_checkpoint, max_model_len=256).engine.plan
    room = plan.blocks_admitted_per_request + 8  # one long request and a bit: five cannot all fit
    llm = engine(
        hybrid_checkpoint, kv_cache_memory=room * plan.bytes_per_block, max_num_batched_tokens=128, max_model_len=256
    )
    got = generate(llm, prompts())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_bits(got, hybrid_reference)


def test_a_follow_up_turn_resumes_in_the_prompt_and_equals_its_run_alone(hybrid_checkpoint):
    """Turn 2 = turn 1's prompt, its answer, new tokens. It may reuse turn 1's prompt (computed as a prompt) but
    not the answer's KV and states (computed one token at a time): with them its bits would differ."""
    llm = engine(hybrid_checkpoint)
    first = prompts()[0]
    out = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    follow = first + list(out) + [11, 12, 13] * 10
    hits = llm.engine.stats().prefix_hit_tokens
    (got,) = generate(llm, [follow])
    assert llm.engine.stats().prefix_hit_tokens - hits == 128  # turn 1's prompt-end checkpoint, not beyond
    (want,) = generate(engine(hybrid_checkpoint, enable_prefix_caching=False), [follow])
    assert_same_bits([got], [want])


def test_turn_end_lets_the_follow_up_resume_after_the_answer_with_the_same_bits(hybrid_checkpoint):
    """turn_end: once turn 1 ends, a background prefill of prompt + answer publishes the answer's last whole
    unit; turn 2 resumes there (past turn 1's prompt-end checkpoint at 128) and equals its run alone. The
    background request is returned to nobody and counted in no statistic."""
    llm = engine(hybrid_checkpoint, state_checkpoints="turn_end")
    unit = llm.engine.plan.state.align
    first = prompts()[0]
    outs = llm.generate([first], replace(GREEDY, max_tokens=80))
    answer = list(outs[0].outputs[0].token_ids)
    assert len(outs) == 1 and llm.engine.stats().prefix_query_tokens == len(first)  # the background: no stat
    follow = first + answer + [11, 12, 13] * 10
    hits = llm.engine.stats().prefix_hit_tokens
    (got,) = generate(llm, [follow])
    resumed = llm.engine.stats().prefix_hit_tokens - hits
    assert resumed == (len(first) + len(answer)) // unit * unit > 128, resumed
    (want,) = generate(engine(hybrid_checkpoint, enable_prefix_caching=False), [follow])
    assert_same_bits([got], [want])


def test_a_turn_end_publish_yields_to_a_user_request(hybrid_checkpoint):
    """The background prefill runs only while the engine is idle: a request arriving meanwhile ends it (what it
    published stays), and that request's answer is the one it gets alone."""
    llm = engine(hybrid_checkpoint, state_checkpoints="turn_end", max_num_batched_tokens=64)
    eng = llm.engine
    first = prompts()[0]
    eng.add_request(first, replace(GREEDY, max_tokens=140))
    while not eng.scheduler.background:
        eng.step()
    eng.step()  # the background request admitted: its first 64-token chunk
    (bg,) = eng.scheduler.running
    assert bg.background and bg.num_computed_tokens > 0
    other = prompts()[1]
    req = eng.add_request(other, GREEDY)
    eng.step()
    assert eng.scheduler.background_dropped == 1 and bg not in eng.scheduler.running
    while eng.has_unfinished():
        eng.step()
    eng.stats(check_integrity=True)
    want = engine(hybrid_checkpoint, enable_prefix_caching=False).generate([other], GREEDY)[0].outputs[0]
    assert req.output_token_ids == list(want.token_ids)


def test_a_turn_end_publish_only_when_the_answer_adds_a_unit():
    from hybridkv.engine.turn_end import turn_end_request
    from hybridkv.request.sampling_params import SamplingParams
    from hybridkv.request.state import Request, RequestStatus

    req = Request("r", list(range(4, 104)), SamplingParams(max_tokens=100), 16)  # P = 100
    for _ in range(20):
        req.append_token(7)  # T = 120
    req.status = RequestStatus.FINISHED_LENGTH
    assert turn_end_request(req, 128, 4096) is None  # P - 1 = 99 -> 0, T = 120 -> 0: nothing new
    publish = turn_end_request(req, 16, 4096)  # 96 -> 112
    assert publish is not None and publish.all_token_ids == req.all_token_ids[:112] + [4]
    assert publish.params.max_tokens == 1
    req.append_token(7)
    req.append_token(7)
    req.append_token(7)
    req.append_token(7)  # T = 124
    assert turn_end_request(req, 62, 4096).all_token_ids[:124] == req.all_token_ids  # E = T: a whole unit
    req.status = RequestStatus.FINISHED_ABORTED
    assert turn_end_request(req, 16, 4096) is None  # only turns that ended normally
    req.status = RequestStatus.FINISHED_STOPPED
    assert turn_end_request(req, 16, 4096) is not None
    assert turn_end_request(req, 16, 112) is None  # E + the filler must fit max_model_len


@pytest.mark.parametrize("policy", ["prompt_end", "last_unit"])
def test_a_shared_system_prompt_gets_a_checkpoint_at_its_branch_point(hybrid_checkpoint, policy):
    """X, Y, Z share a 100-token system prompt. X's checkpoints lie past it; Y finds the system prompt's attention
    blocks cached but no state there, so its prefill stops at the branch point; Z resumes from that checkpoint.
    last_unit (SGLang's extra buffer) checkpoints only each prompt's own end: Z finds nothing to resume."""
    rng = __import__("random").Random(5)
    system = [rng.randrange(4, 500) for _ in range(100)]
    xyz = [system + [rng.randrange(4, 500) for _ in range(50)] for _ in range(3)]
    llm = engine(hybrid_checkpoint, state_checkpoints=policy)
    unit = llm.engine.plan.state.align
    hits = []
    got = []
    for p in xyz:
        before = llm.engine.stats().prefix_hit_tokens
        got += generate(llm, [p])
        hits.append(llm.engine.stats().prefix_hit_tokens - before)
    assert hits == [0, 0, 100 // unit * unit if policy == "prompt_end" else 0]
    assert_same_bits(got, alone(hybrid_checkpoint, xyz))


@pytest.mark.parametrize(("policy", "budget"), [("none", 64), ("chunk_end", 2048), ("chunk_end", 64)])
def test_other_checkpoint_policies_cache_less_and_compute_the_same(hybrid_checkpoint, hybrid_reference, policy, budget):
    """none caches no state; chunk_end caches one only where the budget ends a chunk: with whole-prompt chunks
    nothing (vLLM's "align" mode with a large budget), with 64-token chunks the prompts sharing 130 tokens hit."""
    llm = engine(hybrid_checkpoint, state_checkpoints=policy, max_num_batched_tokens=budget)
    got = [generate(llm, [p])[0] for p in prompts()]
    stats = llm.engine.stats()
    hits = policy == "chunk_end" and budget == 64
    assert (stats.prefix_hit_tokens >= 2 * 128) == hits and (stats.state_checkpoint_bytes > 0) == hits, stats
    assert_same_bits(got, hybrid_reference)


def test_checkpoint_memory_is_reported(hybrid_checkpoint):
    llm = engine(hybrid_checkpoint)
    generate(llm, prompts()[:1])
    stats = llm.engine.stats()
    pages = llm.engine.plan.state.num_pages
    assert stats.state_checkpoint_bytes == pages * llm.engine.plan.bytes_per_block  # one: at 128 (decode: never)
    assert stats.state_blocks_used == 0  # the request finished: only the pool's cache holds the checkpoint


def test_the_bound_on_idle_checkpoints_holds_and_hits_stay_exact(hybrid_checkpoint, hybrid_reference):
    """state_cache_memory of one checkpoint: the pool never keeps more idle, the bound drops the others, a prompt
    sharing a prefix with the one before still resumes, and every answer keeps its bits. A negative bound is
    refused."""
    entry = engine(hybrid_checkpoint).engine.plan.state.bytes_per_request
    llm = engine(hybrid_checkpoint, state_cache_memory=entry)
    pool = llm.engine.kv.pool
    got = []
    for p in prompts():
        got += generate(llm, [p])
        assert len(pool.idle_checkpoints) <= 1
        pool.check_integrity()
    stats = llm.engine.stats()
    assert pool.checkpoints_dropped > 0 and stats.state_checkpoint_bytes <= entry, stats
    assert stats.prefix_hit_tokens > 0, stats  # the newest checkpoint (deepest, most recent) stays to be hit
    assert_same_bits(got, hybrid_reference)
    with pytest.raises(ValueError, match="state_cache_memory"):
        engine(hybrid_checkpoint, state_cache_memory=-1)


def test_a_token_budget_below_the_split_unit_is_refused_with_the_fix(hybrid_checkpoint):
    with pytest.raises(ValueError, match="raise it to at least"):
        engine(hybrid_checkpoint, max_num_batched_tokens=16)


def test_a_model_whose_state_shapes_differ_from_the_plan_is_refused(hybrid_checkpoint, monkeypatch):
    from hybridkv.models.base import CausalLM
    from hybridkv.runner.model_runner import ModelRunner

    llm = engine(hybrid_checkpoint)
    shapes = llm.engine.model.state_shapes()
    layer = min(shapes)
    wrong = {**shapes, layer: (shapes[layer][0], (1, 2, 3))}
    monkeypatch.setattr(CausalLM, "state_shapes", lambda self: wrong)
    monkeypatch.setattr(type(llm.engine.model), "state_shapes", lambda self: wrong)
    with pytest.raises(ValueError, match=re.escape(f"differ from the KV plan's at layers [{layer}]")):
        ModelRunner(llm.engine.model, llm.engine.plan, llm.engine.device)


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_states_stepped_in_the_pool_equal_states_stepped_in_copies(hybrid_checkpoint, hybrid_reference, layout):
    """Qwen3.5's decode steps read and write each request's recurrent state where it lives in the pool (the native
    kernel), including the copy-on-write to fresh pages at a block end; with every state gathered into a copy and
    written back instead (the torch path), the same requests give the same bits."""
    llm = engine(hybrid_checkpoint, kv_layout=layout, enable_prefix_caching=False)
    runner = llm.engine.runner
    if not runner.model.steps_states_in_place or not native_enabled():
        assert runner.state_kernel is None
        pytest.skip("gathered copies only: this model's recurrent layers, or HYBRIDKV_KERNELS=torch")
    assert runner.state_kernel is not None, "the native state-step kernel did not build (see the log)"
    stepped, moved = [], []
    module = runner.state_kernel
    step = module.delta_step

    def counting(*args):
        src, dst = args[5], args[6]
        stepped.append(src.shape[0])
        moved.append(int((src != dst).any(1).sum()))
        return step(*args)

    runner.state_kernel = SimpleNamespace(delta_step=counting, conv_step=module.conv_step)
    in_pool = generate(llm, prompts())
    assert sum(stepped) >= len(prompts()) * (NEW_TOKENS - 1), "decodes did not run in the pool"
    assert sum(moved) > 0, "no decode crossed a block end in the pool (the copy-on-write went untested)"
    assert_same_bits(in_pool, hybrid_reference)

    copies = engine(hybrid_checkpoint, kv_layout=layout, enable_prefix_caching=False)
    copies.engine.runner.state_kernel = None
    assert_same_bits(generate(copies, prompts()), in_pool)
