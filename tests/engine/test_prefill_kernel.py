"""The native bfloat16 prefill kernel through the engine: it runs for prefill runs, and since a query's bits
depend only on its own query and visible keys, chunked prefill and prefix-cache hits give the same bits as one
whole prefill, one-token prompt chunks included (they join the prefill runs, not the decode kernel's). Against
plain torch (HYBRIDKV_KERNELS=torch) it agrees to bfloat16 rounding."""

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.request.sampling_params import SamplingParams
from tests.runner.test_paged_prefill import HAS_BF16_DOT
from tests.tiny_models import build

# Shorter and longer than the window (16); a second run hits 16, 32 and 80 tokens and prefills 1, 8 and 10.
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 90)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

pytestmark = pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16 (torch prefill path)")


@pytest.fixture(scope="module", params=["qwen3", "mistral_sliding"])
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param), head_dim=32)  # the kernel needs D % 32 == 0


def engine(folder, monkeypatch, mode, chunk):
    monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="64MiB", max_num_batched_tokens=chunk)
    calls = []
    kernel = llm.engine.runner.prefill_kernel
    if kernel is not None:
        llm.engine.runner.prefill_kernel = lambda *a: calls.append(a[0].shape[0]) or kernel(*a)
    return llm, calls


def run(llm, prompts=PROMPTS):
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


def test_chunked_and_prefix_hits_give_the_whole_prefill_bits(checkpoint, monkeypatch):
    whole, whole_calls = engine(checkpoint, monkeypatch, "native", 512)
    want = run(whole)
    assert whole_calls and set(whole_calls) == {150}, "the four prompts should be one in-place call per layer"
    for budget in (32, 19):  # 19: the 17-token prompt's last token is a chunk of its own
        chunked, calls = engine(checkpoint, monkeypatch, "native", budget)
        assert run(chunked) == want, budget
        assert calls and max(calls) <= budget
    # The same prompts again: every full block is a prefix hit, the rest is prefilled after the cached prefix.
    before = chunked.engine.scheduler.stats.prefix_hit_tokens
    assert run(chunked) == want
    assert chunked.engine.scheduler.stats.prefix_hit_tokens - before >= 16 + 32 + 80


def test_agrees_with_the_torch_path(checkpoint, monkeypatch):
    native, calls = engine(checkpoint, monkeypatch, "native", 512)
    plain, _ = engine(checkpoint, monkeypatch, "torch", 512)
    assert plain.engine.runner.prefill_kernel is None
    (got_tokens, got), (want_tokens, want) = run(native), run(plain)
    assert calls
    for g, w in zip(got, want):  # the first token's logprob: bfloat16 rounding, before greedy paths can part
        assert abs(g[0] - w[0]) < 0.1
    assert sum(a[:4] == b[:4] for a, b in zip(got_tokens, want_tokens)) >= 3
