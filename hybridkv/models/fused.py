"""Fused elementwise kernels for packable (dense) models on CPU: `act(gate) * up` over a fused gate/up output,
RMSNorm and RoPE in one pass each (`models/kernels/fused_ops.cpp`, built on first use by `hybridkv.native.load_kernel`).
Modules opt in with a `use_fused_ops(ops)` method, which `use_fused_ops` calls once after the weights are packed;
without the kernel (HYBRIDKV_KERNELS=torch, no compiler) they keep their plain-torch forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hybridkv.native import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "fused_ops.cpp"
ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}  # the kernel's activations, by their Hugging Face names


def fused_ops() -> object | None:
    """The compiled module (`act_and_mul`, `rms_norm`, `rope`), or None."""
    return load_kernel(SOURCE)


def use_fused_ops(model: nn.Module, ops: object | None = None) -> int:
    """Hand the kernel (or `ops`, an object with its interface) to every module of `model` that opts in; the
    number that did."""
    ops = fused_ops() if ops is None else ops
    if ops is None:
        return 0
    hooks = [m.use_fused_ops for m in model.modules() if hasattr(m, "use_fused_ops")]
    for hook in hooks:
        hook(ops)
    return len(hooks)


def norm_kernel(
    ops: object, weight: torch.Tensor, eps: float, fallback: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x / rms(x) * weight per row (float32 inside), for a norm whose full scale is `weight`; inputs the
    kernel does not take (not [n, d] / [n, h, d] with d contiguous, other dtypes) go to `fallback`."""
    scale = weight.detach().float().contiguous()
    any_input = getattr(ops, "accepts_any", False)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if any_input or (x.dim() in (2, 3) and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.bfloat16)):
            return ops.rms_norm(x, scale, eps)
        return fallback(x)

    return norm


def rope_kernel(
    ops: object, fallback: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x [n, h, d], cos, sin [n, 1, d]) -> RoPE of every head through the kernel, whose bits are `fallback`'s
    (`rope.apply_rope`) in float32 and bfloat16; `fallback` itself where `ops` has no `rope` (the exact ops) or the
    kernel does not take the inputs."""
    kernel = getattr(ops, "rope", None)
    if kernel is None:
        return fallback

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 3
            and x.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == sin.dtype == x.dtype
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            return kernel(x, cos, sin)
        return fallback(x, cos, sin)

    return rope
