"""The native bfloat16 prefill kernel through the engine: it runs for prefill runs, and since a query's bits
depend only on its own query and visible keys, chunked prefill and prefix-cache hits give the same bits as one
whole prefill, one-token prompt chunks included (they join the prefill runs, not the decode kernel's). Against
plain torch (HYBRIDKV_KERNELS=torch) it agrees to bfloat16 rounding.

Whether the kernel runs is the product's call (`kernels.paged_prefill()`: where this CPU has AVX512-BF16). Each
test runs on this CPU's path and again with the kernel withheld, the torch prefill path other CPUs take, and
checks what the path taken promises: the kernel, the whole prefill's bits; the torch path (flash calls per chunk),
the whole prefill's answers to bfloat16 rounding."""

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.runner import kernels
from tests.tiny_models import build

# Shorter and longer than the window (16); a second run hits 16, 32 and 80 tokens and prefills 1, 8 and 10.
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 90)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["qwen3", "mistral_sliding"])
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param), head_dim=32)  # the kernel needs D % 32 == 0


@pytest.fixture(params=["this-cpu", "torch-prefill"])
def kernel(request, monkeypatch) -> bool:
    """Whether prefills should run on the kernel: the product's answer for this CPU, or withheld."""
    if request.param == "torch-prefill":
        monkeypatch.setattr(kernels, "paged_prefill", lambda: None)
    return kernels.paged_prefill() is not None


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


def assert_close(got, want):
    """Within bfloat16 rounding: each prompt's first logprob (before greedy paths can part) within 0.1, and the
    first four tokens equal for at least three of the four prompts."""
    (got_tokens, got_logprobs), (want_tokens, want_logprobs) = got, want
    for g, w in zip(got_logprobs, want_logprobs):
        assert abs(g[0] - w[0]) < 0.1
    assert sum(a[:4] == b[:4] for a, b in zip(got_tokens, want_tokens)) >= 3


def test_chunked_and_prefix_hits_give_the_whole_prefill_bits(checkpoint, monkeypatch, kernel):
    whole, whole_calls = engine(checkpoint, monkeypatch, "native", 512)
    assert (whole.engine.runner.prefill_kernel is not None) == kernel
    want = run(whole)
    if kernel:
        assert whole_calls and set(whole_calls) == {150}, "the four prompts should be one in-place call per layer"
    for budget in (32, 19):  # 19: the 17-token prompt's last token is a chunk of its own
        chunked, calls = engine(checkpoint, monkeypatch, "native", budget)
        got = run(chunked)
        if kernel:
            assert got == want, budget
            assert calls and max(calls) <= budget
        else:
            assert_close(got, want)
    # The same prompts again: every full block is a prefix hit, the rest is prefilled after the cached prefix.
    before = chunked.engine.scheduler.stats.prefix_hit_tokens
    got = run(chunked)
    if kernel:
        assert got == want
    else:
        assert_close(got, want)
    assert chunked.engine.scheduler.stats.prefix_hit_tokens - before >= 16 + 32 + 80


def test_agrees_with_the_torch_path(checkpoint, monkeypatch, kernel):
    native, calls = engine(checkpoint, monkeypatch, "native", 512)
    plain, _ = engine(checkpoint, monkeypatch, "torch", 512)
    assert plain.engine.runner.prefill_kernel is None
    assert (native.engine.runner.prefill_kernel is not None) == kernel
    got, want = run(native), run(plain)
    assert bool(calls) == kernel
    assert_close(got, want)
