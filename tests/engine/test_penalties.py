"""Presence, frequency and repetition penalties: vLLM's semantics and order, row by row, and through the engine."""

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.runner.sampler import penalize, sample


def test_repetition_then_frequency_and_presence():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, output = [0, 1], [3, 3, 1]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # seen {0, 1, 3}: positive logits halved, negative doubled; then output counts {3: 2, 1: 1}
    expected = torch.tensor([1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 1.0 - 0.25, -2.0])
    torch.testing.assert_close(penalize(row, p, prompt, output), expected)


def test_greedy_pick_follows_the_penalized_logits():
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])
    plain = SamplingParams(temperature=0)
    penalized = SamplingParams(temperature=0, frequency_penalty=2.0)
    history = [([0], [1]), ([0], [1])]  # both rows already generated token 1 once
    assert sample(logits, [plain, penalized], [None, None], (), history) == [1, 2]


@pytest.fixture(scope="module")
def llm(tiny_gemma4):
    return LLM(str(tiny_gemma4), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)


def test_a_huge_repetition_penalty_stops_greedy_repeats(llm):
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0]
    assert len(set(plain.outputs[0].token_ids)) < 48  # the tiny model repeats itself unpenalized
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, repetition_penalty=1e9)
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    # A penalty of 1e9 sends every seen positive logit to ~0 and negative ones to ~-inf: as long as an unseen
    # token has a positive logit, greedy never picks a token it has seen.
    assert len(set(out)) == len(out) and not set(out) & set(prompt)
    llm.engine.kv.check_integrity()


def test_min_tokens_holds_back_eos():
    """The embedded model answers in 3 tokens and EOS; min_tokens bans EOS until then. The ban edits a copy of
    the logits (they come out of inference mode, and logprobs read them raw)."""
    from hybridkv.engine.config import DEFAULT_MODEL_DIR
    from hybridkv.tasks.kv_recall import read_jsonl

    llm = LLM(dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    prompt = read_jsonl(DEFAULT_MODEL_DIR / "heldout.jsonl")[0]["prompt"]
    free = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    eos = free.token_ids[-1]
    assert free.finish_reason == "stop" and eos in llm.engine.eos_token_ids and len(free.token_ids) < 20
    held = llm.generate(prompt, SamplingParams(max_tokens=40, min_tokens=20, temperature=0, logprobs=1))[0]
    tokens = held.outputs[0].token_ids
    assert len(tokens) >= 20 and eos not in tokens[:20]
    assert tokens[: len(free.token_ids) - 1] == free.token_ids[:-1]
    assert held.outputs[0].logprobs[len(free.token_ids) - 1].top[0][0] == eos  # raw logprobs still rank EOS first
