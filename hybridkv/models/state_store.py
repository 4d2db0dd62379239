"""Int8Rows: a recurrent state stored as int8 rows, each with one float32 scale (opt-in, `--mamba-ssm-cache-dtype
int8`): half the bytes of bfloat16, a quarter of float32, so twice or four times the requests per state memory.

    row x [n] float32  ->  scale = max|x| / 127,  q = round_half_even(x * (127 / max|x|))  in [-127, 127]
                           (int8; where 127 / max|x| is not finite, e.g. a row of zeros: scale 0, q 0)
    q, scale           ->  x' = q * scale                                          (float32)

Every step is one IEEE float32 operation, so the torch code here and the native step kernel
(`runner/kernels/state_step.cpp`) round a row to the same bits. A state is rounded where it is stored (after a
chunk, after each decode token) and, inside a longer chunk, at every boundary of the scan's absolute chunk grid
(`round_state`): a prefill split anywhere on that grid, resumed from a checkpoint or handed to a PD decoder rounds
at the same positions as one whole run, so every mode still computes the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LEVELS = 127.0  # int8 codes in [-127, 127]: symmetric, -128 unused


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float32 -> (int8 codes [..., n], float32 scales [...])."""
    x = x.to(torch.float32)
    top = x.abs().amax(-1)
    # One true division per row, as the state-step kernel does (127.f / top): torch's `127.0 / top` is
    # reciprocal(top) * 127, an ulp off in a quarter of rows, which flips a code wherever x * inv nears a half.
    inv = torch.full_like(top, LEVELS) / top
    finite = torch.isfinite(inv)
    up = torch.where(finite, inv, torch.zeros_like(inv))
    codes = torch.round(x * up[..., None]).clamp(-LEVELS, LEVELS)
    return codes.to(torch.int8), torch.where(finite, top / LEVELS, torch.zeros_like(top))


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scales[..., None]


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x as it reads back after being stored as Int8Rows (float32)."""
    return dequantize_rows(*quantize_rows(x))


class Int8Rows:
    """Typed views of a state's int8 codes [..., n] and float32 row scales [...] in a state blob: read as float32
    (`float`, `to`), written by rounding (`copy_`), so a model's state code reads the same for every storage."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.shape[:-1] != scales.shape:
            raise ValueError(f"Int8Rows: int8 codes [..., n], float32 scales [...]; got {codes.shape} {scales.shape}")
        self.codes, self.scales = codes, scales

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def float(self) -> torch.Tensor:
        return dequantize_rows(self.codes, self.scales)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.float().to(dtype)

    def copy_(self, x: torch.Tensor) -> Int8Rows:
        codes, scales = quantize_rows(x)
        self.codes.copy_(codes)
        self.scales.copy_(scales)
        return self


def round_state(state: torch.Tensor | Int8Rows) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a scan applies to its state at each inner boundary of its chunk grid: the storage's rounding for a
    quantized state, None (nothing) for a float state, which is stored as computed."""
    return round_rows if isinstance(state, Int8Rows) else None
