"""What the memory allows: a decode step must read every weight it multiplies by and the KV (or state) of its
context at least once, so one stream's step takes at least those bytes over the device's read bandwidth.

- `read_bandwidth(device)`: bytes per second this process reads (a sum over 512 MiB, best of three);
- `decode_bytes(folder, dtype, context)`: the weights a decode step reads (every tensor of the checkpoint, the
  tied embedding once as the logits head, lookup tables of per-layer inputs left out) plus the KV of `context`
  tokens (sliding layers: their window; states: read and written once);
- `itl_bound_ms`: the two together, the inter-token latency no engine can beat on this device.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

LOOKUP_TABLES = ("embed_tokens_per_layer",)  # read one row per token, not streamed


def read_bandwidth(device: str = "cpu") -> float:
    """Bytes per second one thread (or the GPU) reads: a sum over 512 MiB of float32, best of three."""
    x = torch.ones(128 << 20, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(3):
        sync()
        t = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes(folder: Path, dtype: str) -> int:
    """Bytes of the weights one decode step reads, stored as `dtype`: an untied checkpoint's input embedding is a
    lookup (its `lm_head` is what streams), a tied one's is read whole as the head."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            shapes |= {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    lookups = LOOKUP_TABLES + (("embed_tokens",) if any(n.endswith("lm_head.weight") for n in shapes) else ())
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    return sum(math.prod(shape) * size for name, shape in shapes.items() if not any(t in name for t in lookups))


def kv_bytes(folder: Path, dtype: str, context: int) -> int:
    """Bytes of KV (or recurrent state) one decode step reads at `context` tokens, by the engine's own specs."""
    from hybridkv.kv.model_kv import model_kv_from_hf

    cfg = json.loads((Path(folder) / "config.json").read_text())
    total = 0
    for spec in model_kv_from_hf(cfg, dtype=dtype).specs:
        if spec is None:
            continue
        if spec.per_request_state:
            total += 2 * spec.page_size_bytes  # read, then written back
        else:
            tokens = min(context, spec.window_tokens or context)
            total += tokens * spec.page_size_bytes // spec.block_size
    return total


def itl_bound_ms(folder: Path, dtype: str, context: int, bandwidth: float) -> float:
    return 1e3 * (weight_bytes(folder, dtype) + kv_bytes(folder, dtype, context)) / bandwidth
