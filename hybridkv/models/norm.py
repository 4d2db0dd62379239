"""RMSNorm kernels in plain torch: the reference form, and a three-kernel float32 form for the hot path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
