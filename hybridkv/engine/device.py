"""Which torch device an engine runs on: the config's `device`, else `HYBRIDKV_DEVICE`, else CUDA where torch sees
a GPU, else the CPU. The CPU's native kernels (`hybridkv.native`) serve CPU tensors only; on CUDA every such path
takes its torch code, with the same semantics (the scheduler, the pool and the connectors do not know the device).

    HYBRIDKV_DEVICE=cuda python -m pytest tests/engine   # the tests that create engines, on the GPU
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "HYBRIDKV_DEVICE"
KINDS = ("cpu", "cuda")


def resolve_device(name: str | None = None) -> torch.device:
    """`name` ("cpu", "cuda", "cuda:1"), else $HYBRIDKV_DEVICE, else cuda when available, else cpu. ValueError
    for an unknown kind or a GPU torch cannot see, saying what to change."""
    source = "device" if name else DEVICE_ENV
    name = name or os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{source} {name!r} is not a device: use one of {', '.join(KINDS)} (or cuda:N)") from e
    if device.type not in KINDS:
        raise ValueError(f"{source} {name!r}: hybridkv runs on {' or '.join(KINDS)}, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{source} {name!r}, but this torch sees no CUDA GPU: use cpu, or a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{source} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
