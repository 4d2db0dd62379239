"""bfloat16 linears on CPUs whose oneDNN has no bfloat16 path (AVX2 without AVX-512: AMD Zen 2/3, older Xeons).

There torch's bfloat16 matmul is a scalar loop at ~10 GFLOP/s at every row count, so a 4k prefill or a batch of
16 decodes crawls (measured AMD EPYC Zen 3, one thread: 16 rows x 3072 x 1024 in 9.9 ms, 256 rows in 159 ms;
float32 MKL 2.7 and 21 ms). A `WidenedWeight` keeps the checkpoint's bfloat16 weight (no second copy) and
computes in float32:

    rows <= ROWS_LIMIT   `widened_rows` (models/kernels/widened_rows.cpp): the weight streamed once and widened
                         in registers-sized pieces, 8-lane FMAs; a row's bits do not depend on the rows beside it
    more rows            MKL's float32 matmul over the weight widened BLOCK_ROWS output rows at a time

Either way the sums are float32 and the result rounds once to bfloat16. bfloat16 promises no batch invariance
(`exact_unit` is None), so the switch at ROWS_LIMIT may change a row's last bit, as oneDNN's own kernels do.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridkv.native import load_kernel

SOURCE = Path(__file__).parent / "kernels" / "widened_rows.cpp"
ROWS_LIMIT = 32  # rows up to which the kernel beats widen + MKL (Zen 3, 1 thread: 2.0x at 8, 1.3x at 32, 0.9x at 64)
BLOCK_ROWS = 4096  # output rows widened at once on the matmul path: 16 MiB of float32 at K = 1024


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


def widened_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) through float32 matmuls, BLOCK_ROWS output rows of the weight widened at a time."""
    xf = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for n0 in range(0, weight.shape[0], BLOCK_ROWS):
        n1 = min(weight.shape[0], n0 + BLOCK_ROWS)
        b = None if bias is None else bias[n0:n1].float()
        out[:, n0:n1] = F.linear(xf, weight[n0:n1].float(), b)
    return out


def widen_weight(weight: torch.Tensor) -> WidenedWeight:
    return WidenedWeight(weight)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20


def return_large_blocks() -> bool:
    """Have glibc map every allocation of MMAP_THRESHOLD or more and unmap it when freed. By default it raises
    that threshold up to 32 MiB as blocks are freed and then serves such blocks from its heap, which it keeps:
    after a 4k prefill of Qwen3-0.6B's shape (float32 temporaries of up to 64 MiB per projection) the process
    held 736 MiB it no longer used (AMD EPYC Zen 3: RSS 2380 MiB, 1644 after malloc_trim; peak 2507). With the
    threshold fixed: RSS 1653 after, peak 2248. False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
