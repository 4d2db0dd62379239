"""Command-line options that several commands share, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

BatchInvariant = Annotated[
    bool | None,
    typer.Option(
        "--batch-invariant/--no-batch-invariant",
        help="the same bits in every mode (batch, chunking, prefix hits, preemption, PD, offload): exact sums "
        "and exact steps (float32: decode ~1.4-2x, prefill ~5x slower); default: on in float32 where the "
        "model supports it (bfloat16 keeps the fast paths)",
    ),
]

MambaSsmCacheDtype = Annotated[
    str,
    typer.Option(
        help="recurrent-state models: how states are stored: auto (the model config's) | float32 | bfloat16 | "
        "int8 (rows with a float32 scale each: a quarter of float32's memory, at a small accuracy cost)",
    ),
]
