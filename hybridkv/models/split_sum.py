"""Sums whose result cannot depend on the order of their terms: every partial sum is exact.

A matmul row's bits normally depend on how the BLAS library splits and orders its sum over K, which it chooses
by the number of rows M, the instruction set, the thread count and the operands' alignment (torch 2.13 on an
AMD EPYC and on an Intel Xeon disagree on which M give a row the same bits as a bigger call). Here the sums are
made exact instead, so that no order, split or kernel can change them:

    x [M, K] -> per row m, its largest magnitude sets e_m (|x[m]| < 2^e_m); x / 2^e_m is cut into S slices of
                b bits each: x = 2^e_m * sum_s X_s * 2^(-b s), every X_s an integer with |X_s| < 2^b
                (bits below the last slice are dropped: a fixed function of the row alone);
    w [N, K] -> the same per row n with one slice of 24 bits: w = 2^f_n * W * 2^-24, |W| < 2^24 (exact for
                the elements in the row maximum's binade, a float32 rounding of the others: fixed per weight).

    X_s @ W^T in float64: every term is an integer below 2^(b + 24), K terms stay below 2^(b + 24 + ceil(log2 K))
    = 2^53 with b = 29 - ceil(log2 K), so every partial sum of any subset in any order is an integer that
    float64 holds exactly. The BLAS call computes the exact integer; only our fixed element-wise combination
    afterwards rounds.

                   K                            K                  N
         +--------------------+       +--------------------+   +-------+
    M    | X_1  (b bits/elt)  |       | W (24 bits/elt)    | = | S_1   |  exact integers
         +--------------------+   @   |                    |   +-------+
    M    | X_2                |       |                    |   | S_2   |
         +--------------------+       +--------------------+T  +-------+
    y = ((S_1 + S_2 * 2^-b) [+ S_3 * 2^-2b]) * 2^(e_m + f_n - b - 24), rounded once to float32.

So a row's result is a function of that row and the weight only: the same bits at any M, any thread count, on
any CPU or GPU, whatever BLAS runs underneath. Cost: one float64 matmul of S * M rows (2-3x the float32 flops
at 2x the bytes) and the weight's float64 copy. Accuracy: the error bound of a float32 dot product or better
(x keeps >= 34 bits below its row's maximum, w 24).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from hybridkv.native import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "exact_rows.cpp"
# Slice rows per kernel call: x's rows stay in cache while each column block streams by. The kernel beats MKL's
# float64 GEMM at every row count measured (1.5-6x at 16-256 rows, one thread, Qwen3-0.6B's shapes): it reads a
# float32 weight, and exact integers allow any order.
KERNEL_ROWS = 256
COLUMNS = 32  # the kernel's column block
WEIGHT_BITS = 24  # the float32 significand: the weight's one slice holds its row maximum's binade exactly
EXACT_BITS = 53  # float64 holds every integer below 2^53
MIN_ROW_BITS = 34  # bits of x kept below each row's maximum (more slices when K is large)


def slice_bits(k: int) -> int:
    """Bits per slice of x for a sum over k terms: the largest b with b + 24 + ceil(log2 k) <= 53."""
    bits = EXACT_BITS - WEIGHT_BITS - max(1, math.ceil(math.log2(max(k, 2))))
    if bits < 8:
        raise ValueError(f"an exact sum over {k} terms needs K <= 2^21; split the reduction")
    return bits


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, built from its bits (exact; e clamped to the normal range [-1022, 1023])."""
    return ((e.to(torch.int64).clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


def _row_exponent(x: torch.Tensor) -> torch.Tensor:
    """Per row (last dim), the exponent e with every |x| < 2^e (0 for a row of zeros), int64 [..., 1]."""
    top = x.abs().amax(-1, keepdim=True)
    if top.dtype != torch.float64:
        top = top.to(torch.float32)  # a float64 top stays float64: squares of float32 overflow float32
    _, e = torch.frexp(top)  # top = m * 2^e, m in [0.5, 1): top < 2^e
    return e.to(torch.int64)


def split(x: torch.Tensor, bits: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> (integer-valued float64 slices [slices, ..., K], row exponents [..., 1]):
    x = 2^e * sum_s slices[s] * 2^(-bits * (s + 1)), up to the bits below the last slice."""
    e = _row_exponent(x.detach())
    rest = x.to(torch.float64) * pow2(-e)  # |rest| < 1, exact (a power-of-two scaling of a float32)
    parts = []
    for _ in range(slices):
        rest = rest * 2.0**bits  # exact
        part = torch.trunc(rest)
        parts.append(part)
        rest = rest - part  # exact: the bits below the slice
    return torch.stack(parts), e


class SplitWeight:
    """A weight [N, K] as one integer slice and its row exponents, built once. On CPU with the native kernel
    (`exact_rows`) the slice is kept as float32 (its integers are exact there) in the kernel's column blocks;
    elsewhere as float64 [K, N] for the BLAS. Both compute the same integers."""

    def __init__(self, weight: torch.Tensor) -> None:
        (part,), exponent = split(weight, WEIGHT_BITS, 1)
        self.exponent = exponent.view(-1)  # [N]
        self.out_features, self.in_features = weight.shape
        self.bits = slice_bits(self.in_features)
        self.slices = max(2, math.ceil(MIN_ROW_BITS / self.bits))
        self.kernel = rows_kernel() if weight.device.type == "cpu" else None
        self.columns = pack_columns(part) if self.kernel is not None else None  # [Nb, K, 32] float32
        self.slice_t = None if self.kernel is not None else part.t().contiguous()  # [K, N] float64

    def dense_t(self) -> torch.Tensor:
        """The slice as float64 [K, N], the layout float64 GEMMs stream fastest here."""
        if self.slice_t is not None:
            return self.slice_t
        k = self.in_features
        return self.columns.permute(1, 0, 2).reshape(k, -1)[:, : self.out_features].to(torch.float64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N] in x's dtype; each row's bits depend on that row alone."""
        lead, k = x.shape[:-1], x.shape[-1]
        if self.kernel is not None and x.dtype == torch.float32 and k == self.in_features:
            # The same operations in one native call (`exact_linear`): the same bits, without ~20 torch ops.
            y = self.kernel.exact_linear(x.reshape(-1, k).contiguous(), self.columns, self.exponent,
                                         self.out_features, self.bits, self.slices)  # fmt: skip
            return y.view(*lead, self.out_features)
        return self.combine(*self.integer_sums(x.reshape(-1, k)), x.dtype).view(*lead, self.out_features)

    def combine(self, sums: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The slices' integer sums [S, M, N] and row exponents [M, 1] -> [M, N] in `dtype`, rounded once."""
        total = sums[-1]
        for s in range(self.slices - 2, -1, -1):  # fixed order: the smallest slice first
            total = sums[s] + total * 2.0**-self.bits
        scale = e + self.exponent - (self.bits + WEIGHT_BITS)  # [M, N]
        return (total * pow2(scale)).to(dtype)

    def integer_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (X_s @ W^T for each slice s [S, M, N], exact integers in float64; row exponents [M, 1])."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self.in_features}")
        parts, e = split(x, self.bits, self.slices)  # [S, M, K], [M, 1]
        rows = parts.view(-1, self.in_features)
        if self.kernel is not None:  # the same integers as the BLAS, from half the bytes
            n = self.out_features
            sums = torch.cat([self.kernel.exact_rows(r, self.columns, n) for r in rows.split(KERNEL_ROWS)])
        else:
            sums = rows @ self.dense_t()
        return sums.view(self.slices, x.shape[0], self.out_features), e


def pack_columns(part: torch.Tensor) -> torch.Tensor:
    """An integer-valued slice [N, K] (below 2^24: exact in float32) as float32 column blocks [ceil(N/32), K, 32],
    zero past N: the layout `exact_rows` streams."""
    n, k = part.shape
    blocks = -(-n // COLUMNS)
    padded = part.new_zeros(blocks * COLUMNS, k, dtype=torch.float32)
    padded[:n] = part
    return padded.view(blocks, COLUMNS, k).transpose(1, 2).contiguous()


@functools.cache
def rows_kernel() -> object | None:
    """The compiled `exact_rows` (models/kernels/exact_rows.cpp), or None (kernels off, no compiler)."""
    return load_kernel(SOURCE)


_weights = WeakTensorKeyDictionary()  # weight -> (its version when split, SplitWeight)


def split_weight(weight: torch.Tensor) -> SplitWeight:
    """The `SplitWeight` of a weight tensor, rebuilt when the tensor was written since (its version moved)."""
    held = _weights.get(weight)
    if held is None or held[0] != weight._version:
        held = (weight._version, SplitWeight(weight.detach()))
        _weights[weight] = held
    return held[1]


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """sum(x, -1, keepdim=True) in float64: one integer slice per row (the bits down to 2^-(53 - ceil(log2 K))
    of the row's largest magnitude) summed exactly, so the same bits whatever the row's layout or neighbours."""
    kernel = rows_kernel() if x.device.type == "cpu" and x.dtype == torch.float64 else None
    if kernel is not None:
        return kernel.exact_row_sums(x.reshape(-1, x.shape[-1]).contiguous(), False).view(*x.shape[:-1], 1)
    bits = EXACT_BITS - max(1, math.ceil(math.log2(max(x.shape[-1], 2))))
    (part,), e = split(x, bits, 1)
    return part.sum(-1, keepdim=True) * pow2(e - bits)


def square_sum(x: torch.Tensor) -> torch.Tensor:
    """row_sum of x * x taken in float64 (exact products), x float32 or bfloat16 [..., K] -> float64 [..., 1]."""
    kernel = rows_kernel() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernel is not None:
        return kernel.exact_row_sums(x.reshape(-1, x.shape[-1]).contiguous(), True).view(*x.shape[:-1], 1)
    xd = x.to(torch.float64)
    return row_sum(xd * xd)
