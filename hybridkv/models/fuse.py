"""Fuse several projections of one input into one matmul, without a second copy of the weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    """One matmul for `linears` (all reading the same input). Afterwards each linear's weight (and bias) is a
    view into the fused tensor, so checkpoints and state dicts keep their per-projection shapes."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            has_bias = [lin.bias is not None for lin in linears]
            if any(has_bias) and not all(has_bias):
                raise ValueError("cannot fuse projections where only some have a bias")
            self.bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
            start = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight = nn.Parameter(self.weight[start : start + n], requires_grad=False)
                if self.bias is not None:
                    lin.bias = nn.Parameter(self.bias[start : start + n], requires_grad=False)
                start += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fused(x).split(self.sizes, dim=-1)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side: [..., sum of out_features]."""
        return F.linear(x, self.weight, self.bias)
