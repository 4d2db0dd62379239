"""The runner's native CPU attention kernels (built by `hybridkv.native.load_kernel` on first use), each with a
pure-torch fallback in its caller (`runner/attention.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from hybridkv.native import load_kernel, tiles_allowed

SOURCES = Path(__file__).parent


def paged_decode() -> Callable[..., torch.Tensor] | None:
    """`paged_decode(q, cache, tables, bases, positions, window, scale, sinks)`; see `paged_decode.cpp`."""
    module = load_kernel(SOURCES / "paged_decode.cpp")
    return None if module is None else module.paged_decode


def cache_write() -> Callable[..., None] | None:
    """`write_slots(cache, block_ids, offsets, kv)`: `cache[block_ids, offsets] = kv` for kv in the cache's dtype;
    see `cache_write.cpp`. None where the kernels are off."""
    module = load_kernel(SOURCES / "cache_write.cpp")
    return None if module is None else module.write_slots


def paged_prefill() -> Callable[..., torch.Tensor] | None:
    """`paged_prefill(q, cache, tables, bases, starts, offsets, window, scale, sinks)`, bfloat16; see
    `paged_prefill.cpp`. None where the kernels are off or this CPU has no AVX512-BF16. Its products run on AMX
    tiles where `prefill_path()` says so."""
    module = load_kernel(SOURCES / "paged_prefill.cpp")
    if module is None or not module.supported:
        return None
    return functools.partial(module.paged_prefill, tiles=module.tiles and tiles_allowed())


def prefill_path() -> str | None:
    """How `paged_prefill()` multiplies, for the startup log: "AMX tiles", "AVX512-BF16 dot products", or None."""
    module = load_kernel(SOURCES / "paged_prefill.cpp")
    if module is None or not module.supported:
        return None
    return "AMX tiles" if module.tiles and tiles_allowed() else "AVX512-BF16 dot products"


def state_step() -> object | None:
    """The module with `conv_step` and `delta_step` (one-token recurrent steps on states in the block pool); see
    `state_step.cpp`. None where the kernels are off or did not build."""
    return load_kernel(SOURCES / "state_step.cpp")
