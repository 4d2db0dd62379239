"""Row-invariant matmuls: a token's result must not depend on how many tokens share the call.

CPU GEMM kernels pick another code path for a few rows (measured on torch 2.13 / this CPU: row results for
M in {1, 2, 3, 5, 6, 7, 9, 10, 11} differ in the last bits from the same rows inside a bigger M; M = 4, 8 and
every M >= 12 agree, for every weight shape of the hybrid models and 1 or 2 threads). Recurrent-hybrid models
promise the same bits in every mode (a decode alone or beside others, a prompt whole or chunked), so their
projections pad a call of fewer than `MIN_ROWS` rows up to the next multiple of 4: a lone decode runs 4 rows,
not 16 (a 4-row GEMM costs about 3x a 1-row GEMV on this CPU, a 16-row one about 6x).

Element-wise activations have the same trap: torch's CPU silu, sigmoid and softplus compute the elements left
over after the vector loop with scalar code whose bits differ, so an element's result depends on the tensor's
length (and the thread split). exp, log1p and division do not; the activations here are built from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 12  # from here on, and at multiples of 4 below, a row's bits do not depend on M


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` over x [M, in] whose rows equal those of any bigger call: below MIN_ROWS, M is padded with
    zero rows to the next multiple of 4 and the result cut again."""
    m = x.shape[0]
    if m >= MIN_ROWS or m % 4 == 0:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(m + 4 - m % 4, x.shape[1])
    padded[:m] = x
    return F.linear(padded, weight, bias)[:m]


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), element for element independent of the tensor's size."""
    return torch.reciprocal(torch.exp(-x).add_(1))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), element for element independent of the tensor's size."""
    return x / torch.exp(-x).add_(1)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), and x itself above 20 (torch's default threshold); size-independent like `sigmoid`."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def chunk_bounds(start: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks [a, b) (offsets into a call of n tokens starting at absolute position `start`) of a scan whose
    grid is anchored at the sequence start: cut at every absolute multiple of `chunk`, so a prompt split at such
    a multiple runs the same chunks whole or split."""
    bounds, a = [], 0
    while a < n:
        b = min(n, a + chunk - (start + a) % chunk)
        bounds.append((a, b))
        a = b
    return bounds
