"""A linear weight packed once into oneDNN's blocked layout, and the two readers of it: oneDNN's matmul for
prefill-sized inputs, and a few-row kernel for the rows of a decode step (up to 32), where a linear streams its
weight: the kernel keeps that stream under its arithmetic. Which kernel depends on how oneDNN packs:

    CPU (oneDNN's packing)                      few-row kernel
    AMX, tiles allowed ([Np/32][Kp/2][32][2])   packed_tiles (models/kernels/packed_tiles.cpp, AMX tiles)
    AVX512-BF16 ([Np/64][Kp/2][64][2])          packed_rows  (models/kernels/packed_rows.cpp, VDPBF16PS)

The kernel reads the packed bytes in place: no second copy. It is used for a weight only when it can be trusted
there: bfloat16, the size the layout would have, and a probe product equal to oneDNN's bit for bit (a CPU whose
oneDNN picks another layout or another summation order keeps oneDNN for every row count). So switching readers
with the batch size never changes a row's bits.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hybridkv.native import load_kernel, tiles_allowed

SOURCE = Path(__file__).parent / "kernels" / "packed_rows.cpp"
TILES_SOURCE = Path(__file__).parent / "kernels" / "packed_tiles.cpp"
# rows x threads up to which the kernel beats oneDNN where the weights stream from memory (measured AMD EPYC, Qwen3.5-
# 0.8B shape, decode step: one thread 1.3x at 8 rows, 1.3x at 16, 1.1x at 32; two threads 1.1x at 2 x 2 rows, 1.4x at
# 2 x 4, 1.2x at 2 x 8). Every row count it may take is probed.
ROW_THREADS_LIMIT = 32
PROBE_ROWS = (1, 2, 4, 8, 16, 32)


@functools.cache
def rows_kernel() -> object | None:
    """The few-row kernel for the packing this process's oneDNN gives (module with `linear_rows(x, address, n, k,
    bias)`, `block_n` and `name`): packed_tiles where AMX tiles run, else packed_rows; None where neither applies
    (kernels off, no compiler, or a CPU without AVX512-BF16)."""
    tiles = load_kernel(TILES_SOURCE) if tiles_allowed() else None
    if tiles is not None and tiles.supported:
        return tiles
    ops = load_kernel(SOURCE)
    return ops if ops is not None and hasattr(ops, "linear_rows") else None


class PackedWeight:
    """A [N, K] weight in oneDNN's blocked layout; `self(x, bias)` is `x @ W^T (+ bias)` for x [..., K]."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.address = self._kernel_address(weight)  # None: oneDNN reads it at every row count

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (
            self.address is not None
            and x.dim() == 2
            and x.shape[0] * torch.get_num_threads() <= ROW_THREADS_LIMIT
            and x.dtype == torch.bfloat16
            and x.stride(-1) == 1
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        ):
            return rows_kernel().linear_rows(x, self.address, self.out_features, self.in_features, bias)
        return self.onednn(x, bias)

    def onednn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.tensor, bias, "none", [], "")

    def _kernel_address(self, weight: torch.Tensor) -> int | None:
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or not kernel_matches_onednn(n, k):
            return None
        return readable_address(self.tensor, n, k)


def layout_bytes(n: int, k: int) -> int:
    """Bytes of oneDNN's blocked bf16 layout the kernel reads: [Np/B][Kp/2][B][2], B its `block_n` (64, or 32 for
    AMX), Kp = K up to 32."""
    ops = rows_kernel()
    block = 64 if ops is None else ops.block_n
    return (n + block - 1) // block * block * ((k + 31) // 32 * 32) * 2


def readable_address(packed: torch.Tensor, n: int, k: int) -> int | None:
    """The address of a packed [n, k] bf16 weight if it has the layout's size and the kernel's alignment."""
    address = torch.ops.mkldnn.data_ptr(packed)
    return address if torch.ops.mkldnn._nbytes(packed) == layout_bytes(n, k) and address % 64 == 0 else None


def cancelling_probe(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, k] weight whose rows sum to exactly zero (the second half holds the first half's values negated,
    in another order, magnitudes over 2^+-12) and x [max(PROBE_ROWS), k]: random rows, ones at row 0 and at the
    last row of each probed row count. Against the ones, every output is the rounding residue of its summation
    order, so an order that differs from oneDNN's shows in almost every output."""
    half = k // 2
    scale = torch.exp2(torch.randint(-12, 13, (n, half), generator=generator).float())  # sums that round in fp32
    first = (torch.randn(n, half, generator=generator) * scale).to(torch.bfloat16)
    second = -first.gather(1, torch.rand(n, half, generator=generator).argsort(dim=1))
    tail = torch.zeros(n, k - 2 * half, dtype=torch.bfloat16)
    x = torch.randn(max(PROBE_ROWS), k, generator=generator)
    x[[0, *(rows - 1 for rows in PROBE_ROWS)]] = 1.0
    x = x.to(torch.bfloat16)
    return torch.cat([first, second, tail], dim=1), x


@functools.cache
def kernel_matches_onednn(n: int, k: int) -> bool:
    """Whether the kernel reads oneDNN's packing of a bf16 [n, k] weight and sums in its order, on this CPU: the
    layout's size, and equal bits on a cancelling probe (once per shape; 2-40 ms)."""
    ops = rows_kernel()
    if ops is None:
        return False
    weight, x = cancelling_probe(n, k, torch.Generator().manual_seed(n * 7919 + k))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    address = readable_address(packed, n, k)
    if address is None:
        return False
    for rows in PROBE_ROWS:
        want = torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")
        if not torch.equal(ops.linear_rows(x[:rows], address, n, k, None), want):
            return False
    return True


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    return PackedWeight(weight)
