"""Decode attention alone against the memory: the native in-place kernel (`runner/kernels/paged_decode.cpp`, the
path this CPU compiled: AVX-512, AVX2 or generic) and the torch path (gather + SDPA), over one KV cache per layer
so the context streams from memory as in a real step, reported as the KV bytes read per second and as a share of
this process's read bandwidth (`bounds.read_bandwidth`, measured in the same run).

    python benchmarks/bench_decode_attention.py [--contexts 1024,4096] [--batch 1] [--threads 1] [--repeats 5]
        [--shape qwen3-0.6b|gemma3-270m] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bounds import read_bandwidth

from hybridkv.runner import kernels
from hybridkv.serve.startup import cpu_line

SHAPES = {  # query heads, KV heads, head size, layers with their own KV (full attention)
    "qwen3-0.6b": (16, 8, 128, 28),
    "gemma3-270m": (4, 1, 256, 3),
}
BLOCK = 16


def caches(layers: int, blocks: int, hk: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(blocks + 1, BLOCK, 2, hk, d).to(dtype) for _ in range(layers)]  # block 0: the null block


def torch_decode(q, cache, tables, positions, scale):
    """What the engine runs without the kernel: gather the blocks token-major, then SDPA under a mask."""
    b, span = tables.shape
    _, bs, _, hk, d = cache.shape
    kv = torch.index_select(cache, 0, tables.view(-1)).view(b, span * bs, 2, hk, d)
    keys, values = kv.permute(2, 0, 3, 1, 4).unbind(0)
    mask = torch.zeros(b, 1, 1, span * bs, dtype=q.dtype)
    for r, p in enumerate(positions.tolist()):
        mask[r, ..., p + 1 :] = float("-inf")
    qp = q.view(b, hk, q.shape[1] // hk, d)
    return torch.nn.functional.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=scale)


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hq, hk, d, layers = SHAPES[args.shape]
    kernel = kernels.paged_decode()
    bandwidth = read_bandwidth()
    print(f"cpu: {cpu_line()}; reads {bandwidth / 1e9:.1f} GB/s; {args.threads} thread(s)")
    print(f"{args.shape}: {hq} query heads, {hk} KV heads, head size {d}, {layers} layers, batch {args.batch}, "
          f"{args.dtype}")  # fmt: skip
    print("| context | path | ms per step (all layers) | KV GB/s | share of read bandwidth |")
    print("|---|---|---|---|---|")
    for context in [int(c) for c in args.contexts.split(",")]:
        for name, sec, read in measure(kernel, context, args.batch, (hq, hk, d, layers), dtype, args.repeats):
            gbs = read / sec / 1e9
            print(f"| {context} | {name} | {sec * 1e3:.1f} | {gbs:.1f} | {gbs * 1e9 / bandwidth:.0%} |")


def measure(kernel, context: int, batch: int, shape: tuple[int, int, int, int], dtype: torch.dtype, repeats: int):
    """(path, best seconds for all layers, KV bytes read) per path at one context."""
    hq, hk, d, layers = shape
    span = -(-context // BLOCK)
    kv = caches(layers, batch * span, hk, d, dtype)
    tables = (torch.arange(batch * span) + 1).view(batch, span)
    bases = torch.zeros(batch, dtype=torch.long)
    positions = torch.full((batch,), context - 1, dtype=torch.long)
    q = torch.randn(batch, hq, d).to(dtype)
    scale = d**-0.5
    read = layers * batch * context * 2 * hk * d * kv[0].element_size()

    def torch_path():
        for c in kv:
            torch_decode(q, c, tables, positions, scale)

    def native_path():
        for c in kv:
            kernel(q, c, tables, bases, positions, 0, scale, None)

    paths = {"torch": torch_path} | ({"native": native_path} if kernel is not None else {})
    return [(name, best_seconds(fn, repeats), read) for name, fn in paths.items()]


if __name__ == "__main__":
    main()
