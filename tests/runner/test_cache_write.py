"""The native cache write (`runner/kernels/cache_write.cpp`): new tokens' keys and values land in their slots
exactly as `cache[block_ids, offsets] = kv` puts them, in either layout, and nothing else changes; slots outside
the cache are refused, not written."""

import pytest
import torch

from hybridkv.runner import kernels


@pytest.fixture(scope="module")
def write():
    kernel = kernels.cache_write()
    assert kernel is not None, "the cache write kernel did not build (see the log)"
    return kernel


def slots(n: int, blocks: int, bs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(seed))[:n]
    return flat // bs, flat % bs


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
@pytest.mark.parametrize("n", [1, 5, 300, 1000])  # one token, a decode batch, chunks past the 256-token grain
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_advanced_indexing(write, layout, n, dtype):
    g = torch.Generator().manual_seed(n)
    pool = torch.randn(80, 3, 16, 2, 4, 32, generator=g).to(dtype)  # packed: [blocks, layers, bs, 2, Hk, D]
    cache = pool[:, 1] if layout == "packed" else pool[:, 1].clone()
    before = pool.clone()
    kv = torch.randn(n, 2, 4, 32, generator=g).to(dtype)
    block_ids, offsets = slots(n, 80, 16, n)
    want = cache.clone()
    want[block_ids, offsets] = kv
    write(cache, block_ids, offsets, kv)
    assert torch.equal(cache, want)
    if layout == "packed":  # the other layers' bytes of every block are untouched
        assert torch.equal(pool[:, 0], before[:, 0]) and torch.equal(pool[:, 2], before[:, 2])


def test_refuses_what_it_cannot_write(write):
    cache = torch.zeros(4, 16, 2, 2, 32, dtype=torch.bfloat16)
    kv = torch.ones(2, 2, 2, 32, dtype=torch.bfloat16)
    for block_ids, offsets in (([0, 4], [0, 0]), ([0, -1], [0, 0]), ([0, 0], [0, 16]), ([0, 0], [-1, 0])):
        with pytest.raises(RuntimeError, match="outside the cache"):
            write(cache, torch.tensor(block_ids), torch.tensor(offsets), kv)
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        write(cache, torch.tensor([0]), torch.tensor([0]), kv)
    with pytest.raises(RuntimeError, match="dtype"):
        write(cache, torch.tensor([0, 1]), torch.tensor([0, 1]), kv.float())
    with pytest.raises(RuntimeError, match="shapes"):
        write(cache, torch.tensor([0, 1]), torch.tensor([0, 1]), torch.ones(2, 2, 2, 64, dtype=torch.bfloat16))
    assert cache.abs().sum() == 0, "a refused write changes nothing"


def test_the_engine_writes_through_it(tmp_path):
    """On CPU every step's new keys and values go through the kernel (the torch fallback would hide its loss)."""
    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams
    from tests.tiny_models import build

    llm = LLM(str(build("qwen3", tmp_path / "m", head_dim=32)), dtype="bfloat16", kv_cache_memory="16MiB")
    runner, calls = llm.engine.runner, []
    real = runner.write_kernel
    assert real is not None
    runner.write_kernel = lambda cache, block_ids, offsets, kv: (
        calls.append(kv.shape[0]) or real(cache, block_ids, offsets, kv)
    )
    llm.generate([list(range(5, 25))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    layers = len(runner.memory.views)
    assert calls == [20] * layers + [1] * 2 * layers, "the prompt, then two decode steps, every layer"
