"""The widened bfloat16 linear (`models/widened.py`, `models/kernels/widened_rows.cpp`): what a bfloat16 model's
projections run through on a CPU whose oneDNN has no bfloat16 path (AVX2 without AVX-512).

The kernel builds on every AVX2 CPU, so its tests run on AVX-512 machines too; the routing test forces the
widened packer where oneDNN would pack, so every CPU checks that a model's projections really take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.engine.llm import LLM
from hybridkv.models import linear, registry, widened
from hybridkv.models.widened import WidenedWeight, widened_kernel, widened_matmul
from hybridkv.serve.startup import kernel_lines, linear_readers
from tests.hybrid_util import generate
from tests.tiny_models import build

pytestmark = pytest.mark.skipif(widened_kernel() is None, reason="widened_rows needs AVX2 and FMA (and a compiler)")

# (N, K): N off the 4-output blocks, K off the 8-lane steps, a K of one step, a long K
SHAPES = [(1, 8), (5, 13), (100, 72), (130, 1000), (64, 3072), (7, 1029)]
ROWS = (1, 2, 3, 4, 5, 7, 16)


def operands(n: int, k: int, rows: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def assert_float32_sum_rounded_once(got: torch.Tensor, x, w, b) -> None:
    """Within one bfloat16 rounding of the float64 product: a float32 sum (any order) rounded once."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-30)  # the size of the sum's float32 error
    tol = torch.finfo(torch.bfloat16).eps * want.abs() + 1e-6 * scale
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert bool(((got.double() - want).abs() <= tol).all()), float(((got.double() - want).abs() / tol).max())


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_float64_to_one_rounding(n, k, rows, bias):
    x, w, b = operands(n, k, rows, n * 31 + k, bias)
    assert_float32_sum_rounded_once(widened_kernel().widened_rows(x, w, b), x, w, b)


def test_reads_a_weight_whose_rows_are_strided():
    """A fused projection's member, or a slice of columns: rows contiguous, row stride past K."""
    x, wide, b = operands(40, 96, 5, 3, True)
    w = wide[:, 10:70]
    assert w.stride(0) == 96
    assert_float32_sum_rounded_once(widened_kernel().widened_rows(x[:, 10:70].contiguous(), w, b), x[:, 10:70], w, b)


@pytest.mark.parametrize(("n", "k"), [(130, 1029), (132, 1021), (132, 640)])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_or_the_threads(n, k):
    """One or two rows widen the weight in registers (one row with K <= 1024 eight weight rows at a time, then a
    last block of four: n = 132), more through a scratch: the same sums either way."""
    x, w, b = operands(n, k, 16, 5, True)
    ops, threads = widened_kernel(), torch.get_num_threads()
    together = ops.widened_rows(x, w, b)
    for i in range(x.shape[0]):
        assert torch.equal(ops.widened_rows(x[i : i + 1], w, b)[0], together[i])
        assert torch.equal(ops.widened_rows(x[i : i + 2], w, b)[0], together[i])
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(ops.widened_rows(x, w, b), together)
    finally:
        torch.set_num_threads(threads)


def test_refuses_operands_it_cannot_read():
    ops = widened_kernel()
    x, w, _ = operands(8, 16, 2, 0, False)
    for bad in ((x.float(), w, None), (x, w.float(), None), (x, w[:, :8], None), (x, w, torch.zeros(3).bfloat16())):
        with pytest.raises(RuntimeError):
            ops.widened_rows(*bad)


class Counting:
    def __init__(self, rows: list[int], real: object) -> None:
        self.real, self.rows = real, rows

    def widened_rows(self, x, *rest):
        self.rows.append(x.shape[0])
        return self.real.widened_rows(x, *rest)


def test_a_weight_sends_few_rows_to_the_kernel_and_more_to_float32_matmuls(monkeypatch):
    rows: list[int] = []
    real = widened_kernel()
    monkeypatch.setattr(widened, "widened_kernel", lambda: Counting(rows, real))
    x, w, b = operands(130, 200, widened.ROWS_LIMIT + 3, 7, True)
    weight = WidenedWeight(w)
    for m in (1, widened.ROWS_LIMIT, widened.ROWS_LIMIT + 3):
        assert_float32_sum_rounded_once(weight(x[:m], b), x[:m], w, b)
    assert rows == [1, widened.ROWS_LIMIT], "rows up to the limit through the kernel, more through matmuls"
    assert weight(x.view(1, -1, 200)[:, :3], b).shape == (1, 3, 130), "leading dimensions kept"


def test_the_matmul_widens_the_weight_in_blocks_and_multiplies_rows_in_pieces(monkeypatch):
    x, w, b = operands(130, 200, 40, 9, True)
    whole = widened_matmul(x, w, b)
    monkeypatch.setattr(widened, "BLOCK_ROWS", 32)  # 5 blocks, the last short
    monkeypatch.setattr(widened, "ROW_PIECE", 16)  # 3 pieces, the last short
    assert_float32_sum_rounded_once(widened_matmul(x, w, b), x, w, b)
    assert (widened_matmul(x, w, b).float() - whole.float()).abs().max() <= 0.05


def test_the_product_widens_exactly_where_onednn_cannot_pack_bfloat16():
    cpu = torch.device("cpu")
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert linear.weight_packer(cpu, torch.bfloat16) is (linear.pack_weight if onednn else widened.widen_weight)
    assert linear.weight_packer(cpu, torch.float32) is linear.pack_weight, "float32 is never widened"


def bf16_engine(monkeypatch, folder, packer) -> LLM:
    monkeypatch.setattr(registry, "weight_packer", lambda device, dtype: packer)
    return LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB")


def test_a_bfloat16_model_runs_its_projections_widened(tmp_path, monkeypatch):
    """Forced on every CPU (where oneDNN packs bfloat16 the product picks oneDNN): each projection, fused ones and
    the tied head included, becomes a WidenedWeight, the startup line says so, and the first logits of each prompt
    (one prefill, then one decode row each) agree with plain torch's bfloat16 matmuls to bfloat16 rounding."""
    monkeypatch.delenv("HYBRIDKV_KERNELS", raising=False)
    folder = build("qwen3", tmp_path / "m", head_dim=32, hidden_size=128, intermediate_size=256)
    batch = [[5, 9, 200, 17, 3, 88] * 4, [11, 12, 13]]
    llm = bf16_engine(monkeypatch, folder, widened.widen_weight)
    readers = linear_readers(llm.engine.model)
    assert readers and all(isinstance(r, WidenedWeight) for r in readers)
    assert any(r.out_features == llm.engine.model.embed_tokens.num_embeddings for r in readers), "the tied head"
    (line,) = [line for line in kernel_lines(llm.engine) if line.startswith("linears: ")]
    assert line.startswith(f"linears: {len(readers)} bfloat16 weights widened to float32")
    got = generate(llm, batch)
    want = generate(bf16_engine(monkeypatch, folder, None), batch)
    for g, w in zip(got, want, strict=True):
        span = float(w[0].amax() - w[0].amin())
        assert float((g[:2] - w[:2]).abs().max()) <= 0.03 * span
