"""Batch-invariant mode for attention models: every projection, norm and activation of a model computed so that a
token's bits depend on that token's inputs alone (`exact`), through the hooks the fast paths already use.

    projections   pack_linears(model, ExactWeight)   every Linear, FusedLinear and a tied lm_head
    norms, act*up use_fused_ops(model, EXACT_OPS)     the fused-ops interface (rms_norm, act_and_mul), exact
    the rest      module.use_exact()                  what a model computes its own way (Gemma 4's head norm,
                                                      its per-layer-input gate)

Attention is the runner's part (`runner/step_index.py`, exact steps). A model class opts in with
`CausalLM.batch_invariant`; recurrent hybrids are always exact (they call `exact` directly).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models import exact
from hybridkv.models.fused import ACT_CODES, use_fused_ops
from hybridkv.models.linear import pack_linears
from hybridkv.models.split_sum import SplitWeight


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, as x / (1 + exp(-2u)) with u = sqrt(2 / pi) (x + 0.044715 x^3): equal to
    0.5 x (1 + tanh(u)) and built from size-independent kernels (`exact`)."""
    u = (x + 0.044715 * x * x * x) * 0.7978845608028654
    return x / torch.exp(u * -2.0).add_(1)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GELU, 0.5 x (1 + erf(x / sqrt(2))): erf runs through torch's vectorised math map like exp."""
    return x * 0.5 * (torch.erf(x * 0.7071067811865476) + 1)


ACTIVATIONS = {"silu": exact.silu, "gelu": gelu_erf, "gelu_pytorch_tanh": gelu_tanh}
_BY_CODE = {code: ACTIVATIONS[name] for name, code in ACT_CODES.items()}


class ExactWeight:
    """A linear weight for `pack_linears`: `self(x, bias)` is x @ W^T (+ bias) with exact sums."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.split = SplitWeight(weight.detach())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.split(x)
        return y if bias is None else y + bias


class ExactOps:
    """The fused-ops kernel's interface (`models/kernels/fused_ops.cpp`) in exact arithmetic. Takes any input
    (`accepts_any`): its callers never fall back to their plain forms."""

    accepts_any = True

    @staticmethod
    def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * exact.rms_scale(xf, eps) * scale).to(x.dtype)

    @staticmethod
    def act_and_mul(x: torch.Tensor, code: int) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return _BY_CODE[code](gate) * up


EXACT_OPS = ExactOps()


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a loaded model (weights final, projections fused, nothing packed) to exact arithmetic."""
    pack_linears(model, ExactWeight)
    use_fused_ops(model, EXACT_OPS)
    for module in model.modules():
        if hasattr(module, "use_exact"):
            module.use_exact()
