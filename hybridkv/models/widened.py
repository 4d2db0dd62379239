"""bfloat16 linears on CPUs whose oneDNN has no bfloat16 path (AVX2 without AVX-512: AMD Zen 2/3, older Xeons).

There torch's bfloat16 matmul is a scalar loop at ~10 GFLOP/s at every row count, so a 4k prefill or a batch of
16 decodes crawls (measured AMD EPYC Zen 3, one thread: 16 rows x 3072 x 1024 in 9.9 ms, 256 rows in 159 ms;
float32 MKL 2.7 and 21 ms). A `WidenedWeight` keeps the checkpoint's bfloat16 weight (no second copy) and
computes in float32:

    rows <= ROWS_LIMIT   `widened_rows` (models/kernels/widened_rows.cpp): the weight streamed once and widened
                         in registers-sized pieces, 8-lane FMAs; a row's bits do not depend on the rows beside it
    more rows            MKL's float32 matmul over the weight widened BLOCK_ROWS output rows at a time,
                         ROW_PIECE rows of x at a time, in buffers reused from call to call

Either way the sums are float32 and the result rounds once to bfloat16. bfloat16 promises no batch invariance
(`exact_unit` is None), so the switch at ROWS_LIMIT may change a row's last bit, as oneDNN's own kernels do.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from hybridkv.models.buffers import BufferCache
from hybridkv.native import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "widened_rows.cpp"
ROWS_LIMIT = 32  # rows up to which the kernel beats widen + MKL (Zen 3, 1 thread: 2.0x at 8, 1.3x at 32, 0.9x at 64)
BLOCK_ROWS = 4096  # output rows widened at once on the matmul path: 16 MiB of float32 at K = 1024
ROW_PIECE = 256  # rows of x per float32 matmul on that path: 4 MiB of float32 output at BLOCK_ROWS


@functools.cache
def widened_kernel() -> object | None:
    """The compiled module, or None (kernels off, no compiler, or a CPU without AVX2 and FMA)."""
    ops = load_kernel(SOURCE)
    return ops if ops is not None and ops.supported else None


def widening_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU whose oneDNN cannot pack it, where the kernel built."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and widened_kernel() is not None
    )


class WidenedWeight:
    """A [N, K] bfloat16 weight; `self(x, bias)` is `x @ W^T (+ bias)` for x [..., K], summed in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        kernel = widened_kernel()
        if (
            kernel is not None
            and rows.shape[0] <= ROWS_LIMIT
            and rows.dtype == torch.bfloat16
            and (bias is None or bias.dtype == torch.bfloat16)
        ):
            out = kernel.widened_rows(rows.contiguous(), self.weight, None if bias is None else bias.contiguous())
        else:
            out = widened_matmul(rows, self.weight, bias)
        return out.view(*x.shape[:-1], self.out_features)


class Scratch(threading.local):
    """The matmul path's float32 buffers (`models/buffers.py`), one set per thread (Qwen3-0.6B's shape: 16 + 3 + 4
    MiB). Allocated afresh, they were a 2048-token prefill step's largest temporaries, faulted in on every call."""

    def __init__(self) -> None:
        self.cache = BufferCache()

    def take(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A [rows, cols] float32 view of buffer `name`, its contents undefined."""
        return self.cache.get(name, (rows, cols), torch.float32, device)


SCRATCH = Scratch()


def widened_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) through float32 matmuls, BLOCK_ROWS output rows of the weight widened at a time and
    ROW_PIECE rows of x widened and multiplied at a time, all in `SCRATCH`: a call's only new memory is its
    result."""
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, BLOCK_ROWS):
        n1 = min(n, n0 + BLOCK_ROWS)
        w = SCRATCH.take("weight", n1 - n0, k, x.device).copy_(weight[n0:n1])
        b = None if bias is None else bias[n0:n1].float()
        for m0 in range(0, m, ROW_PIECE):
            m1 = min(m, m0 + ROW_PIECE)
            xs = SCRATCH.take("rows", m1 - m0, k, x.device).copy_(x[m0:m1])
            part = SCRATCH.take("part", m1 - m0, n1 - n0, x.device)
            if b is None:
                torch.mm(xs, w.t(), out=part)
            else:
                torch.addmm(b, xs, w.t(), out=part)
            out[m0:m1, n0:n1] = part
    return out


def widen_weight(weight: torch.Tensor) -> WidenedWeight:
    return WidenedWeight(weight)
