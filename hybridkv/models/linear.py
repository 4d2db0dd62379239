"""Linear layers whose weights can be reordered once into oneDNN's blocked layout, so that every matmul after that
skips the per-call weight reorder (measured on this CPU, one thread, the 28 layers of Qwen3-0.6B's projections:
bf16 1.6x at 1 row, 1.7x at 16, 1.1x at 128; fp32 2.3x at 16 rows, 1.6x at 128).

`pack_linears(model)` packs every `Linear` and every `FusedLinear` of a model whose class opts in
(`CausalLM.packable`), on CPU, in bf16 or fp32. Packing drops the dense weight: the parameter keeps its shape
on the meta device, so reading it afterwards fails loudly instead of silently using stale data. Models whose
modes promise the same bits at any row count (recurrent hybrids, `exact.linear`) do not opt in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models import exact
from hybridkv.models.fuse import FusedLinear, pack_weight, packed_linear, release
from hybridkv.models.widened import widen_weight, widening_wanted
from hybridkv.native import native_enabled

PACKED_DTYPES = (torch.bfloat16, torch.float32)
Packer = Callable[[torch.Tensor], Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        native_enabled()
        and device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        # oneDNN packs bfloat16 only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; an AVX2 CPU (or a cap at it) widens
        # bfloat16 weights instead (`widened.py`)
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def weight_packer(device: torch.device, dtype: torch.dtype) -> Packer | None:
    """How a model's projections run on this device: oneDNN's packed layout where oneDNN packs the dtype, bfloat16
    weights widened to float32 where it cannot (AVX2 CPUs), else None (plain torch)."""
    if packing_available(device, dtype):
        return pack_weight
    if native_enabled() and widening_wanted(device, dtype):
        return widen_weight
    return None


class Linear(nn.Linear):
    """`nn.Linear` that runs through a packed weight once `pack` was called."""

    packed: torch.Tensor | None = None

    def pack(self, packer: Packer = pack_weight) -> None:
        self.packed = packer(self.weight)
        release(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class TiedLogits(nn.Module):
    """The logits matmul of a model whose lm_head is its input embedding: through a packed copy of the table (the
    table itself stays, for lookups), which costs vocab x hidden more bytes and saves ~2/3 of the logits time."""

    def __init__(self, embedding: nn.Embedding, packer: Packer = pack_weight) -> None:
        super().__init__()
        self.packed = packer(embedding.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed_linear(hidden, self.packed, None)


def pack_linears(model: nn.Module, packer: Packer = pack_weight) -> int:
    """Pack every FusedLinear (held as a plain attribute of a module) and every other `Linear`; the number packed.
    A fused projection's members are views of its weight, so they are released, not packed again. A tied
    lm_head (`lm_head` None beside an `embed_tokens`) becomes a `TiedLogits`. `packer`: weight -> a callable
    `(x, bias) -> x @ W^T + bias` (oneDNN's layout by default; `batch_invariant.ExactWeight` for exact sums)."""
    members: set[int] = set()
    count = 0
    for module in model.modules():
        for value in list(vars(module).values()):
            if isinstance(value, FusedLinear) and value.packed is None:
                members.update(id(lin) for lin in value.linears)
                value.pack(packer)
                count += 1
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in members and module.packed is None:
            module.pack(packer)
            count += 1
    if getattr(model, "lm_head", False) is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        model.lm_head = TiedLogits(model.embed_tokens, packer)
        count += 1
    return count


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection of a model that computes in exact sums where it is not packed (recurrent hybrids): through the
    packed weight once `pack_linears` packed it (a tied head became `TiedLogits`), else `exact.linear`."""
    if getattr(module, "packed", None) is not None:
        return module(x)
    return exact.linear(x, module.weight, module.bias)


def project_fused(fused: FusedLinear, x: torch.Tensor) -> torch.Tensor:
    """`project` for a `FusedLinear`: all outputs side by side."""
    return fused.fused(x) if fused.packed is not None else exact.linear(x, fused.weight, fused.bias)


def output_logits(
    hidden: torch.Tensor, embedding: nn.Embedding, lm_head: nn.Module | None, softcap: float | None = None
) -> torch.Tensor:
    """[M, hidden] -> [M, vocab]: through `lm_head` (a Linear, or `TiedLogits` once packed), else the tied
    embedding table; then tanh softcapping when the model has one (Gemma)."""
    logits = F.linear(hidden, embedding.weight) if lm_head is None else lm_head(hidden)
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)
