"""Row-invariant matmuls: a token's result must not depend on how many tokens share the call.

CPU GEMM kernels pick another code path for a few rows (measured on torch 2.13 / this CPU: row results for
M in {1, 2, 3, 5, 6, 7, 9, 10, 11} differ in the last bits from the same rows inside a bigger M; M = 4, 8 and
every M >= 12 agree). Recurrent-hybrid models promise the same bits in every mode (a decode alone or beside
others, a prompt whole or chunked), so their projections pad the rows to at least `MIN_ROWS`.

Element-wise activations have the same trap: torch's CPU silu, sigmoid and softplus compute the elements left
over after the vector loop with scalar code whose bits differ, so an element's result depends on the tensor's
length (and the thread split). exp, log1p and division do not; the activations here are built from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` over x [M, in] whose rows equal those of any bigger call: fewer than MIN_ROWS rows are padded
    with zeros and cut again."""
    m = x.shape[0]
    if m >= MIN_ROWS:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(MIN_ROWS, x.shape[1])
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
