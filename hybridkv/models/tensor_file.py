"""Reading a safetensors file straight into the model's tensors: no mapping of the file, no temporary copy.

    [8 bytes: header length n, little-endian][n bytes: JSON {name: {dtype, shape, data_offsets}, ...}][data]

`safe_open` maps the whole file and hands out a fresh tensor per name; copying those into the parameters kept
the file's pages and the parameters resident together (twice the weights at the load's peak: 8.1 GB for
Gemma-4-E2B's 3.9 GB). Here a tensor whose stored dtype is the parameter's is read by `readinto` into the
parameter's own bytes; another dtype goes through one temporary of that tensor's size, then a cast.

Offsets and sizes come from the file: each is checked against the file's length and the tensor's shape first.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

STORED = {  # safetensors dtype names -> torch
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets in the file (header included)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def stored_tensors(f: BinaryIO, path: Path) -> Iterator[StoredTensor]:
    """The tensors `f` holds, in file order, each checked against the file's length; ValueError names the file."""
    size = path.stat().st_size
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER, size - 8):
        raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes)")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entry = entry if isinstance(entry, dict) else {}
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (
            entry.get("dtype") not in STORED
            or not isinstance(shape, list)
            or not all(isinstance(s, int) and s >= 0 for s in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
        ):
            raise ValueError(f"{path}: tensor {name} has an unreadable or unsupported entry {entry!r}")
        dtype, shape, (lo, hi) = STORED[entry["dtype"]], tuple(shape), offsets
        start, end = 8 + n + lo, 8 + n + hi
        if not 8 + n <= start <= end <= size or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name} ({entry['dtype']} {list(shape)}) has bytes [{lo}, {hi}) "
                             "that do not match its shape or lie outside the file")  # fmt: skip
        entries.append(StoredTensor(name, dtype, shape, start, end))
    yield from sorted(entries, key=lambda e: e.start)


def read_into(f: BinaryIO, stored: StoredTensor, target: torch.Tensor) -> None:
    """Fill `target` (the stored tensor's shape) with the stored values, cast to target's dtype."""
    f.seek(stored.start)
    direct = target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
    dest = target if direct else torch.empty(stored.shape, dtype=stored.dtype)
    view = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < stored.nbytes:  # a raw read returns at most ~2 GiB
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{stored.name}: the file ended inside its bytes")
        done += got
    if not direct:
        target.copy_(dest)
