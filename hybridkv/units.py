"""Byte sizes as users write them: 4GiB, 512MiB, 2GB, 1.5G, 4096."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Bytes from an int or a string with an optional unit (KiB/MiB/GiB/TiB or K/M/G/T binary, KB/MB/GB/TB
    decimal)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write bytes or a number with a unit, e.g. 4GiB, 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
