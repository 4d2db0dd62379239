"""Fuse several projections of one input into one matmul, without a second copy of the weights; weights packed
once into oneDNN's blocked layout, read by oneDNN or, for the few rows of a decode step, by `packed_rows`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.packed_rows import PackedWeight, pack_weight

__all__ = ["FusedLinear", "PackedWeight", "pack_weight", "packed_linear", "release"]


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return packed(x, bias)


def release(linear: nn.Linear) -> None:
    """Replace a linear's dense weight by a meta tensor of the same shape (its bytes live in a packed copy)."""
    w = linear.weight
    linear.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


class FusedLinear:
    """One matmul for `linears` (all reading the same input). Afterwards each linear's weight (and bias) is a
    view into the fused tensor, so checkpoints and state dicts keep their per-projection shapes."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.packed: PackedWeight | None = None  # oneDNN's layout of `weight`, set by `pack`
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
        return self.fused(x).split_with_sizes(self.sizes, dim=-1)  # not Tensor.split's Python wrapper: per layer

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side: [..., sum of out_features]."""
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self, packer: Callable[[torch.Tensor], PackedWeight] = pack_weight) -> None:
        """Run through a packed copy of the weight (oneDNN's blocked layout unless `packer` says otherwise); the
        dense weight and its member views are released."""
        self.packed = packer(self.weight)
        self.weight = torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta")
        for lin in self.linears:
            release(lin)
