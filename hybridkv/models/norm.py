"""RMSNorm kernels in plain torch: the reference form, and a three-kernel float32 form for the hot path."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models import exact
from hybridkv.models.fused import norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: computed in float32, scaled by `weight` (not `1 + weight`), or unscaled."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps).type_as(x)


def scaled_rms_norm(x: torch.Tensor, scaled_weight: torch.Tensor, root_eps: torch.Tensor) -> torch.Tensor:
    """float32 `rms_norm` over the last dim d, given scaled_weight = sqrt(d) * weight, root_eps = sqrt(d * eps):
    x / sqrt(mean(x^2) + eps) * weight = x / hypot(|x|, sqrt(d * eps)) * sqrt(d) * weight. Three kernels where
    the CPU `rms_norm` runs about ten; equal to it within float32 rounding (~1e-6), so half precision keeps
    `rms_norm`, whose op order makes it bit-exact with transformers."""
    return torch.div(x, torch.linalg.vector_norm(x, dim=-1, keepdim=True).hypot_(root_eps)).mul_(scaled_weight)


def norm_constants(dim: int, eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The constants of `scaled_rms_norm` for a float32 weight; None for other dtypes."""
    if weight.dtype != torch.float32:
        return None
    return weight * dim**0.5, torch.tensor((dim * eps) ** 0.5, device=weight.device)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), in float32, then back to x's dtype: the plain form (offset 0, weight
    starting at 1: Nemotron-H) or zero-centred (offset 1, weight starting at 0: Qwen3.5). Per-row reductions only,
    so a row's bits do not depend on the rows beside it."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `use_fused_ops` (dense models)

    def use_fused_ops(self, ops: object) -> None:
        self.kernel = norm_kernel(ops, self.offset + self.weight.detach().float(), self.eps, self.plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x) if self.kernel is None else self.kernel(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * exact.rms_scale(xf, self.eps)
        scale = self.weight.float() if self.offset == 0.0 else self.offset + self.weight.float()
        return (xf * scale).to(x.dtype)
