"""The few-row linear kernel (`models/kernels/packed_rows.cpp`) reads oneDNN's packed bf16 weight in place and
gives oneDNN's bits at every row count, so routing a decode step's rows to it changes nothing; `PackedWeight`
routes only the few rows it wins at, and keeps oneDNN where the load-time probe disagrees."""

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.models import packed_rows
from hybridkv.models.packed_rows import PackedWeight, cancelling_probe, layout_bytes, rows_kernel
from hybridkv.request.sampling_params import SamplingParams
from tests.tiny_models import build

pytestmark = pytest.mark.skipif(rows_kernel() is None, reason="no AVX512-BF16 (or no compiler): oneDNN only")

# (N, K): N and K off the 64 / 32 blocks, K at and past oneDNN's 512 / 1024 K blocks
SHAPES = [(100, 72), (130, 1000), (256, 1024), (192, 2048), (64, 3072), (80, 1536), (320, 1100)]


class Counting:
    """The kernel module, recording the row count of every call."""

    def __init__(self, rows: list[int]) -> None:
        self.real, self.rows = rows_kernel(), rows

    def linear_rows(self, x, *rest):
        self.rows.append(x.shape[0])
        return self.real.linear_rows(x, *rest)


def onednn(x, weight, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias, "none",
                                              [], "")  # fmt: skip


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bits_equal_onednn_at_every_row_count(n, k):
    g = torch.Generator().manual_seed(n + k)
    weight, probe = cancelling_probe(n, k, g)  # residues: any other summation order shows
    bias = torch.randn(n, generator=g).bfloat16()
    packed = PackedWeight(weight)
    assert packed.address is not None
    assert torch.ops.mkldnn._nbytes(packed.tensor) == layout_bytes(n, k)
    assert (onednn(probe[:1], weight) != 0).float().mean() > 0.5, "the probe should leave rounding residues"
    for m in (1, 2, 3, 4, 5, 8, 13):
        x = torch.cat([probe, torch.randn(m, k, generator=g).bfloat16()])[:m]
        for b in (None, bias):
            got = rows_kernel().linear_rows(x, packed.address, n, k, b)
            assert torch.equal(got, onednn(x, weight, b)), (m, b is not None)


def test_strided_rows_are_read_as_rows():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    wide = torch.randn(3, 200, generator=g).bfloat16()
    x = wide[:, 10:74]  # row stride 200, K = 64
    packed = PackedWeight(weight)
    assert torch.equal(rows_kernel().linear_rows(x, packed.address, 96, 64, None), onednn(x.contiguous(), weight))


@pytest.mark.parametrize(("threads", "kernel_rows"), [(1, (1, 2, 3, 4)), (2, (1, 2))])
def test_routes_only_the_rows_it_wins_at(monkeypatch, threads, kernel_rows):
    calls = []
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    packed = PackedWeight(weight)
    monkeypatch.setattr(packed_rows, "rows_kernel", lambda: Counting(calls))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for m in range(1, 9):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(packed(x, None), onednn(x, weight))
    assert tuple(calls) == kernel_rows
    assert PackedWeight(weight.float()).address is None, "float32 weights stay on oneDNN"


def test_a_probe_that_disagrees_keeps_onednn(monkeypatch):
    real = rows_kernel()

    class OffByOneUlp:
        def linear_rows(self, x, address, n, k, bias):
            out = real.linear_rows(x, address, n, k, bias)
            return (out.view(torch.int16) + (out != 0)).view(torch.bfloat16)

    monkeypatch.setattr(packed_rows, "rows_kernel", lambda: OffByOneUlp())
    packed_rows.kernel_matches_onednn.cache_clear()
    try:
        assert PackedWeight(torch.randn(64, 96).bfloat16()).address is None
    finally:
        packed_rows.kernel_matches_onednn.cache_clear()


def test_refuses_what_it_cannot_read():
    packed = PackedWeight(torch.randn(64, 64).bfloat16())
    ops = rows_kernel()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        ops.linear_rows(torch.randn(1, 64), packed.address, 64, 64, None)
    with pytest.raises(RuntimeError, match="aligned"):
        ops.linear_rows(torch.randn(1, 64).bfloat16(), packed.address + 2, 64, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_rows(torch.randn(1, 64).bfloat16(), packed.address, 64, 64, torch.zeros(63).bfloat16())
    with pytest.raises(RuntimeError, match="features"):  # reading past the weight
        ops.linear_rows(torch.randn(1, 128).bfloat16(), packed.address, 64, 64, None)
    with pytest.raises(RuntimeError):  # the same through the module: oneDNN's own refusal, not a stray read
        packed(torch.randn(1, 128).bfloat16(), None)


def test_engine_decode_runs_the_kernel_and_keeps_its_bits(tmp_path, monkeypatch):
    """A bf16 model whose K crosses oneDNN's 512 block (intermediate 1100): one request decodes on the kernel,
    and its tokens and logprobs equal a run whose linears all stay on oneDNN."""
    folder = build("qwen3", tmp_path / "m", head_dim=32, hidden_size=128, intermediate_size=1100)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [list(range(7, 47))]

    def run(limit):
        monkeypatch.setattr(packed_rows, "ROW_THREADS_LIMIT", limit)
        rows = []
        real = rows_kernel()
        monkeypatch.setattr(packed_rows, "rows_kernel", lambda: Counting(rows))
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="32MiB")
        rows.clear()  # the load-time probes
        out = llm.generate(prompt, params)[0].outputs[0]
        monkeypatch.setattr(packed_rows, "rows_kernel", lambda: real)
        return out.token_ids, [lp.logprob for lp in out.logprobs], rows

    fast_tokens, fast_logprobs, rows = run(torch.get_num_threads())  # one row per thread
    slow_tokens, slow_logprobs, none = run(0)
    assert rows and set(rows) == {1} and len(rows) >= 15 * 4, "every decode step's linears should use the kernel"
    assert not none
    assert fast_tokens == slow_tokens and fast_logprobs == slow_logprobs
