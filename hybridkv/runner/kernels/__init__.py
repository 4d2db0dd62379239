"""Native CPU kernels, compiled on first use by torch's C++ extension loader (g++ and ninja), each with a
pure-torch fallback in its caller.

The build lands in `$HYBRIDKV_CACHE_DIR/kernels/<torch>-<cpu>` (default `~/.cache/hybridkv`), keyed by the torch
version and this CPU's instruction-set flags, since it is compiled with `-march=native`. `HYBRIDKV_KERNELS=torch`
turns every kernel off (the fallbacks then run); a machine that cannot build one logs why, once, and falls back.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from hybridkv.native import KERNELS_ENV, native_enabled

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent


def _build_dir() -> Path:
    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    cpu = hashlib.sha256(flags.encode()).hexdigest()[:12]
    root = Path(os.environ.get("HYBRIDKV_CACHE_DIR", Path.home() / ".cache" / "hybridkv"))
    return root / "kernels" / f"torch{torch.__version__}-{cpu}"


def _headers_digest(name: str) -> str:
    """A digest of `<name>*.h`: the loader rebuilds when its sources or flags change, and headers reach it here."""
    digest = hashlib.sha256()
    for header in sorted(SOURCES.glob(f"{name}*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _load(name: str) -> object | None:
    """The compiled module of `<name>.cpp`, or None (the build failed: logged once)."""
    from torch.utils.cpp_extension import load

    build = _build_dir()
    try:
        build.mkdir(parents=True, exist_ok=True)
        log.info("loading native kernel %s (compiled once per machine into %s, about a minute)", name, build)
        return load(
            f"hybridkv_{name}",
            [str(SOURCES / f"{name}.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DHYBRIDKV_SOURCES={_headers_digest(name)}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
        )
    except Exception as e:  # no compiler, no ninja, a read-only home: the torch path still works
        log.warning("native kernel %s unavailable, using the torch path (%s: %s); set %s=torch to skip the build",
                    name, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", KERNELS_ENV)  # fmt: skip
        return None


def paged_decode() -> Callable[..., torch.Tensor] | None:
    """`paged_decode(q, cache, tables, bases, positions, window, scale, sinks)`; see `paged_decode.cpp`."""
    module = _load("paged_decode") if native_enabled() else None
    return None if module is None else module.paged_decode


def paged_prefill() -> Callable[..., torch.Tensor] | None:
    """`paged_prefill(q, cache, tables, bases, starts, offsets, window, scale, sinks)`, bfloat16; see
    `paged_prefill.cpp`. None where the kernels are off or this CPU has no AVX512-BF16."""
    module = _load("paged_prefill") if native_enabled() else None
    return None if module is None or not module.supported else module.paged_prefill
