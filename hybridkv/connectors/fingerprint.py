"""A cheap identity for a checkpoint: peers that exchange KV must run the same weights, not just the same shapes."""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE = 64 << 10  # bytes read at each of a few fixed places in every weight file


def model_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of config.json and, per safetensors file, its name, size, header and three sampled chunks
    (start, middle, end). Reads a few hundred KB however large the checkpoint is."""
    folder = Path(model_dir)
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for at in (0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)):
                f.seek(at)
                h.update(f.read(SAMPLE))
    return h.hexdigest()
