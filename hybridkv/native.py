"""One switch for the native fast paths: `HYBRIDKV_KERNELS=native` (the default) lets models pack their linear
weights for oneDNN (`models/linear.py`) and the runner use its compiled kernels (`runner/kernels`);
`HYBRIDKV_KERNELS=torch` runs plain torch everywhere (the reference the fast paths are tested against)."""

from __future__ import annotations

import os

KERNELS_ENV = "HYBRIDKV_KERNELS"
MODES = ("native", "torch")


def native_enabled() -> bool:
    mode = os.environ.get(KERNELS_ENV, "native")
    if mode not in MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "native"
