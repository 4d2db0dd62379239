"""Exact sums (`models/split_sum.py`, `models/exact.py`): a row's bits depend on that row and the weight alone.
The sharpest check of "no summation order can change it" is to change the order: permuting K permutes every
dot product's terms, which moves a BLAS sum's bits (checked below) but not an exact one's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models import exact
from hybridkv.models.split_sum import SplitWeight, row_sum, rows_kernel, slice_bits, split, split_weight

SHAPES = [(64, 48), (96, 512), (1024, 384), (3000, 70)]  # (K, N): K not a power of two or a vector width too


def data(k: int, n: int, m: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over 2^+-8 inside each row, so that sums round in float32 and their order shows.
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 9, (m, k), generator=g).float())
    return x, torch.randn(n, k, generator=g) * 0.05


def worst_case(k: int, n: int, m: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Every term near its slice's largest value and of one sign: the integer sums come within a factor ~2 of the
    2^53 bound, so slices one bit too wide would round (and their order would show)."""
    g = torch.Generator().manual_seed(3)
    return 1 - torch.rand(m, k, generator=g) / 4, 1 - torch.rand(n, k, generator=g) / 4


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("make", [data, worst_case])
def test_permuting_the_sum_changes_no_bit(k, n, make):
    x, w = make(k, n)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    got = exact.linear(x[:, order], w[:, order])
    assert torch.equal(got, exact.linear(x, w))
    # The same permutation moves a BLAS sum: the check above could fail.
    assert not torch.equal(F.linear(x[:, order], w[:, order]), F.linear(x, w))


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_row_has_the_same_bits_at_every_row_count_and_place(k, n):
    x, w = data(k, n)
    whole = exact.linear(x, w)
    for m in (1, 2, 3, 5, 7, 12, 16, 17):
        for start in (0, 3, 37 - m):
            assert torch.equal(exact.linear(x[start : start + m], w), whole[start : start + m]), (m, start)
    reversed_rows = exact.linear(x.flip(0), w).flip(0)
    assert torch.equal(reversed_rows, whole)


def test_thread_count_changes_no_bit():
    x, w = data(1024, 384, m=64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = exact.linear(x, w)
        torch.set_num_threads(2)
        two = exact.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_as_accurate_as_a_float32_matmul(k, n):
    x, w = data(k, n)
    truth = x.double() @ w.double().t()
    ours = (exact.linear(x, w).double() - truth).abs().max()
    blas = (F.linear(x, w).double() - truth).abs().max()
    assert ours <= blas * 1.5 + 1e-30, (ours, blas)


@pytest.mark.parametrize("k", [64, 96, 1024])
def test_the_blas_sums_are_the_exact_integers_even_in_the_worst_case(k):
    """Computed again in int64 (exact by definition): any rounding inside the float64 matmul would show here,
    long before it reaches a float32 output."""
    x, w = worst_case(k, 64, m=16)
    sw = SplitWeight(w)
    sums, _ = sw.integer_sums(x)
    parts, _ = split(x, sw.bits, sw.slices)
    exact_sums = torch.stack([p.long() @ sw.dense_t().long() for p in parts])
    assert sums.abs().max() > 2.0**51  # near the bound: one bit more per slice would round
    assert torch.equal(sums.long(), exact_sums)


def test_the_integer_sums_stay_below_2_to_the_53():
    for k in (2, 64, 100, 4096, 1 << 21):
        assert slice_bits(k) + 24 + max(1, (k - 1).bit_length()) <= 53
    with pytest.raises(ValueError, match="split the reduction"):
        slice_bits((1 << 21) + 1)


def test_zero_rows_bias_leading_dims_and_dtypes():
    x, w = data(64, 32, m=6)
    x[2] = 0
    b = torch.randn(32)
    y = exact.linear(x.view(2, 3, 64), w, b)
    assert y.shape == (2, 3, 32) and torch.equal(y.view(6, 32)[2], b)
    assert SplitWeight(w)(x.bfloat16()).dtype == torch.bfloat16
    # bfloat16 makes no bit-for-bit promise: the plain matmul
    assert torch.equal(exact.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    with pytest.raises(ValueError, match="features"):
        SplitWeight(w)(x[:, :10])


def test_a_weight_written_in_place_is_split_again():
    x, w = data(64, 32)
    first = exact.linear(x, w)
    assert split_weight(w) is split_weight(w)  # built once
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(exact.linear(x, w), first * 2)


def test_row_sum_and_rms_scale_ignore_order():
    x, _ = data(3000, 1)
    order = torch.randperm(3000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(row_sum(x[:, order]), row_sum(x))
    assert torch.equal(exact.rms_scale(x[:, order], 1e-6), exact.rms_scale(x, 1e-6))
    assert not torch.equal(x[:, order].sum(-1), x.sum(-1))  # torch's own sum moves
    torch.testing.assert_close(
        row_sum(x), x.double().sum(-1, keepdim=True), rtol=1e-10, atol=0
    )  # bits 2^-41 below the max dropped


@pytest.mark.parametrize("k", [64, 1000, 3072])
def test_the_native_kernel_and_the_blas_give_the_same_integers(k):
    """On CPU with the native kernels `exact_rows` reads a float32 copy of the slice; the BLAS path reads float64.
    Both must be the exact integers, so switching between them changes no bit (here: every row count)."""
    x, w = worst_case(k, 70, m=300)
    sw = SplitWeight(w)
    if rows_kernel() is None:
        assert sw.kernel is None and sw.columns is None
        pytest.skip("native kernels off or unavailable here: the BLAS path alone (the matrix's torch run)")
    assert sw.kernel is not None and sw.slice_t is None  # the path the product takes on this machine
    parts, _ = split(x, sw.bits, sw.slices)
    rows = parts.view(-1, k)
    blas = rows @ sw.dense_t()
    for m in (1, 2, 5, 17, 300, 600):
        assert torch.equal(sw.kernel.exact_rows(rows[:m].contiguous(), sw.columns, 70), blas[:m]), m
    assert torch.equal(sw(x), exact.linear(x, w))


@pytest.mark.parametrize(("k", "n"), [*SHAPES, (64, 8208), (2048, 64), (1, 5)])
def test_the_one_call_kernel_gives_the_torch_steps_bits(k, n):
    """`exact_linear` and `exact_row_sums` (one native call each) against the torch steps they replace: split,
    integer sums, combination; row exponents over a wide range, zero rows and columns, subnormal and huge
    inputs (squares past float32's range)."""
    kernel = rows_kernel()
    if kernel is None:
        pytest.skip("native kernels are off or did not build")
    g = torch.Generator().manual_seed(k + n)
    for m in (1, 4, 7, 32, 100):
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-30, 30, (m, k), generator=g).float())
        x[0, : k // 2] = 0
        if m > 4:
            x[2] = 0
            x[3, ::3] = 1e-40  # subnormal
            x[4, 0] = 3e38  # its square is past float32's range
        w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 5, (n, 1), generator=g).float())
        w[min(3, n - 1)] = 0
        sw = SplitWeight(w)
        steps = sw.combine(*sw.integer_sums(x), x.dtype)  # the torch steps (sums from the BLAS-equal kernel)
        assert torch.equal(sw(x), steps), m
        xd = x.double()
        assert torch.equal(exact.square_sum(x), torch_row_sum(xd * xd)), m
        assert torch.equal(row_sum(xd), torch_row_sum(xd)), m


def torch_row_sum(x: torch.Tensor) -> torch.Tensor:
    """`row_sum` in torch steps: one slice of 53 - ceil(log2 K) bits per row, summed."""
    bits = 53 - max(1, (x.shape[-1] - 1).bit_length())
    (part,), e = split(x, bits, 1)
    return part.sum(-1, keepdim=True) * torch.exp2((e - bits).double())
