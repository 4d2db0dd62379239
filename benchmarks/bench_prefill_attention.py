"""Prefill attention alone: the native bfloat16 kernel (`runner/kernels/paged_prefill.cpp`) on its vector path
(AVX512-BF16 dot products) and, where the CPU has AMX, on its tile path, one causal prompt read in place from a
paged cache, side by side in one process; reported as ms per layer and GFLOP/s (4 x heads x D x n^2 / 2).

    python benchmarks/bench_prefill_attention.py [--tokens 4096] [--threads 1] [--repeats 3]
        [--shapes qwen3-0.6b,gemma3-270m]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridkv.native import load_kernel
from hybridkv.runner import kernels
from hybridkv.serve.startup import cpu_line

SHAPES = {"qwen3-0.6b": (16, 8, 128), "gemma3-270m": (4, 1, 256)}  # query heads, KV heads, head size
BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = load_kernel(kernels.SOURCES / "paged_prefill.cpp")
    if module is None or not module.supported:
        raise SystemExit("the native prefill kernel does not run on this CPU (it needs AVX512-BF16)")
    paths = ["vector", "tiles"] if module.tiles else ["vector"]
    print(f"cpu: {cpu_line()}; {args.threads} thread(s); paths: {', '.join(paths)}")
    print("| shape | tokens | path | ms per layer | GFLOP/s |")
    print("|---|---|---|---|---|")
    n = args.tokens
    for shape in args.shapes.split(","):
        hq, hk, d = SHAPES[shape]
        g = torch.Generator().manual_seed(0)
        blocks = (n + BLOCK - 1) // BLOCK
        cache = torch.randn(blocks + 1, BLOCK, 2, hk, d, generator=g).bfloat16()  # block 0: the null block
        q = torch.randn(n, hq, d, generator=g).bfloat16()
        places = (torch.arange(1, blocks + 1)[None], torch.tensor([0]), torch.tensor([0]), torch.tensor([0, n]))
        flops = 4 * hq * d * n * n / 2
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.repeats + 1):  # paths alternate; the best round counts, so the first warms up
            for path in paths:
                start = time.perf_counter()
                module.paged_prefill(q, cache, *places, 0, d**-0.5, None, tiles=path == "tiles")
                best[path] = min(best[path], time.perf_counter() - start)
        for path in paths:
            print(f"| {shape} | {n} | {path} | {best[path] * 1e3:.1f} | {flops / best[path] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
