"""What the model fingerprint costs: a ~1 GiB random safetensors checkpoint in a temp folder, fingerprinted

- cold: every byte hashed (the cache file removed before each rep), as at a checkpoint's first engine start;
- warm: the cached digest, as at every later start (a stat per file and a small JSON read);
- for reference: the old sampler (name, size and three 64 KiB chunks per file: not a full identity), a plain
  `readinto` of every byte without hashing, and SHA-256 over bytes already in memory.

The files were just written, so all figures are with a warm page cache (dropping it needs root and a sync); from a
cold disk the full hash runs at the lower of the disk's read speed and the hash speed.

    python benchmarks/bench_fingerprint.py [--gib 1] [--shards 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridkv.connectors.identity import CACHE_NAME, CHUNK, model_fingerprint

SAMPLE = 64 << 10


def build(folder: Path, gib: float, shards: int) -> int:
    per_tensor = 64 << 20  # bytes
    count = max(shards, round(gib * (1 << 30) / per_tensor))
    torch.manual_seed(0)
    for s in range(shards):
        names = range(s, count, shards)
        tensors = {f"model.layers.{i}.mlp.weight": torch.randn(per_tensor // 4 // 4096, 4096) for i in names}
        save_file(tensors, folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    return sum(p.stat().st_size for p in folder.iterdir())


def old_sampled(folder: Path) -> str:
    """The fingerprint this replaced (config, then per weight file its name, size and start/middle/end chunks)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for at in (0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)):
                f.seek(at)
                h.update(f.read(SAMPLE))
    return h.hexdigest()


def raw_read(folder: Path) -> None:
    buf = bytearray(CHUNK)
    for path in sorted(folder.iterdir()):
        with path.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def timed(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-fingerprint-"))
    try:
        total = build(folder, args.gib, args.shards)
        raw_read(folder)  # the page cache now holds every file
        cache, block = folder / CACHE_NAME, bytes(256 << 20)
        rows = [
            ("cold: full hash", timed(lambda: model_fingerprint(folder), args.reps, lambda: cache.unlink(True)), total),
            ("warm: cached digest", timed(lambda: model_fingerprint(folder), args.reps), None),
            ("old sampler (reference)", timed(lambda: old_sampled(folder), args.reps), None),
            ("raw readinto, no hash", timed(lambda: raw_read(folder), args.reps), total),
            ("sha256 in memory, 256 MiB", timed(lambda: hashlib.sha256(block), args.reps), 256 << 20),
        ]
        head = f"{total / (1 << 30):.2f} GiB in {args.shards} safetensors file(s)"
        print(f"{head}, warm page cache, median of {args.reps}")
        print(f"{'':28}{'time':>12}{'GB/s':>10}")
        for name, seconds, nbytes in rows:
            speed = f"{nbytes / seconds / 1e9:.2f}" if nbytes else "-"  # only where every byte is read
            print(f"{name:28}{seconds * 1e3:>9.2f} ms{speed:>10}")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
