"""One bad request never changes another: extreme sampling values sample sanely, and a request whose sampling
fails anyway fails alone while the others in its steps produce exactly what they produce alone."""

from __future__ import annotations

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.request.state import RequestStatus
from hybridkv.runner import sampler

PROMPTS = ["Remember these codes.\n- ant 58\n- bee 17\nQ: what is bee?\nA: bee", "the quick brown fox", "hi", "1 2 3"]
NORMAL = [
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=11),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_k=5, seed=12),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, top_p=0.9, repetition_penalty=1.2, seed=13),
]
POISON = [
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-300),
    SamplingParams(max_tokens=8, ignore_eos=True, top_p=1e-300, seed=5),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1e-300, seed=6),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1e300, temperature=1e-4, seed=7),
    SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1e-300, temperature=1e-4, seed=9),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=100, top_k=1, seed=8),
]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="16MiB", max_model_len=512)


def run(llm: LLM, prompts, params) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("poison", POISON, ids=lambda p: repr(p)[14:70])
def test_extreme_sampling_values_sample_sanely_beside_four_normal_requests(llm, poison):
    alone = run(llm, PROMPTS, NORMAL)
    outs = run(llm, [*PROMPTS, PROMPTS[0]], [*NORMAL, poison])
    assert outs[:4] == alone  # the four are untouched, token for token
    vocab = llm.engine.vocab_size
    assert len(outs[4]) == 8 and all(0 <= t < vocab for t in outs[4])
    if poison.temperature < 1e-5:  # vLLM's rule: a tiny temperature is greedy
        assert outs[4] == run(llm, [PROMPTS[0]], [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)])[0]


def test_a_request_whose_sampling_fails_fails_alone(llm, monkeypatch):
    draw = sampler._draw

    def broken(logits, p, generator):  # a failure only this request's values trigger
        if p.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return draw(logits, p, generator)

    monkeypatch.setattr(sampler, "_draw", broken)
    alone = run(llm, PROMPTS, NORMAL)
    engine = llm.engine
    reqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, NORMAL)]
    bad = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=666))
    while engine.has_unfinished():
        engine.step()
    assert [tuple(r.output_token_ids) for r in reqs] == alone
    assert bad.status is RequestStatus.FINISHED_ERROR and "sampling failed: RuntimeError" in bad.error
    engine.kv.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0


def test_no_penalty_makes_a_logit_nan_that_greedy_would_pick():
    """0 x inf: a seen token whose logit is exactly 0 under a 1e300 repetition penalty (inf in float32) is nan,
    which argmax takes for the largest; it must be the least likely instead."""
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    p = SamplingParams(temperature=0, repetition_penalty=1e300)
    assert sampler.sample(logits, [p], [None], history=[([0], [])]) == [3]
