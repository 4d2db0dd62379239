"""Row-invariant operations: a token's result never depends on how many tokens share the call, on the thread
count or on the CPU's BLAS. Models whose modes promise the same bits (float32: any batch, chunking, prefix hit,
preemption, PD or offload gives the single run's logits) compute every projection and norm through here.

- `linear`: the sum over K is exact (`split_sum`), so no summation order of any BLAS can change it. (The old
  rule "pad M below 12 to a multiple of 4" was a measurement of one CPU's MKL; on an Intel Xeon it failed.)
- `rms_scale`: a row's mean square through the same exact sum.
- Element-wise activations are built from exp, log1p, reciprocal and division: torch runs those through its
  vectorised math map (aten/src/ATen/cpu/vml.h), which also computes the tail of a tensor with the vector
  function on a partial load, so an element's bits come from one function of that element. torch's own silu,
  sigmoid and softplus compute the tail with scalar code instead: an element's bits then depend on the tensor's
  length and thread split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.models.split_sum import row_sum, split_weight, square_sum

__all__ = ["chunk_bounds", "linear", "rms_scale", "row_sum", "sigmoid", "silu", "softplus", "square_sum"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose row bits depend on that row and the weight alone (exact sums, rounded once), in float32,
    the dtype whose modes promise the same bits; other dtypes take the plain matmul (5-10x faster: bench_shapes)."""
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    y = split_weight(weight)(x)
    return y if bias is None else y + bias


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2, -1) + eps) in float32 [..., 1], the mean square summed exactly."""
    return torch.rsqrt((square_sum(x) / x.shape[-1]).to(torch.float32) + eps)


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
