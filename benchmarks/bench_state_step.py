"""Decode steps of a recurrent hybrid whose time is its states: Qwen3.5-0.8B's state layout (18 Gated DeltaNet
layers, 16 heads of 128 x 128, float32: 18.7 MiB per request) with tiny compute (hidden 64, vocab 512), a batch
of decoding requests, against the floor of reading and writing every state once at this process's measured copy
bandwidth. Side by side in one run: states stepped in the pool (the native kernel) and the torch path (each
state gathered into a copy, stepped by `gated_delta_step` and written back).

    python benchmarks/bench_state_step.py [--batch 32] [--prompt 64] [--steps 12] [--threads 1] [--json]
                                          [--state-dtypes float32 int8] [--paths pool copies]

With several --state-dtypes (`--mamba-ssm-cache-dtype`) each is measured in the same run, against the floor of its
own state bytes and against the first one's step time.

Target (issue 30): time per request-step <= 3x the floor (it was ~17x with gathered copies and torch matmuls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import hybrid_models
import torch


def copy_floor(nbytes: int, repeats: int = 5) -> float:
    """Seconds to read `nbytes` and write them elsewhere once (`copy_` of one buffer into another, best of)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def decode_steps(folder: Path, args: argparse.Namespace, in_pool: bool, state_dtype: str) -> dict:
    from hybridkv import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype="float32", kv_cache_memory=args.memory, max_model_len=1024, max_num_seqs=args.batch,
        max_num_batched_tokens=2048, enable_prefix_caching=False, mamba_ssm_cache_dtype=state_dtype,
    )  # fmt: skip
    engine = llm.engine
    if not in_pool:
        engine.runner.state_kernel = None
    elif engine.runner.state_kernel is None:
        raise SystemExit("the native state-step kernel is not built here (see the log): nothing to measure")
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for r in range(args.batch):
        engine.add_request([4 + (r * 7 + i) % 500 for i in range(args.prompt)], params)
    while any(not req.output_token_ids for req in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    plan = engine.plan
    return {
        "path": f"{state_dtype} {'in pool' if in_pool else 'copies'}",
        "step_ms": statistics.median(times) * 1e3,
        "ms_per_request_step": statistics.median(times) / args.batch * 1e3,
        "state_bytes": plan.state.blob_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed (crossing block ends included)")
    parser.add_argument("--memory", default="4GiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "int8"])
    paths = ["pool", "copies"]  # the in-pool kernel; the torch path with gathered copies
    parser.add_argument("--paths", nargs="+", default=paths, choices=paths, help="default: both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = hybrid_models.build(Path(tmp) / "state-0.8b", "state-0.8b")
        paths = [p == "pool" for p in args.paths]
        rows = [decode_steps(folder, args, pool, d) for d in args.state_dtypes for pool in paths]
    for r in rows:
        r["floor_ms"] = copy_floor(r["state_bytes"] * args.batch) / args.batch * 1e3
        r["vs_floor"] = r["ms_per_request_step"] / r["floor_ms"]
        r["vs_first"] = r["step_ms"] / rows[0]["step_ms"]
    state, floor = rows[0]["state_bytes"], rows[0]["floor_ms"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    gbps = 2 * state / (floor / 1e3) / 1e9
    print(f"state {state / 2**20:.1f} MiB/request, batch {args.batch}, {args.threads} thread(s); floor (read + write "
          f"once, copy bandwidth {gbps:.1f} GB/s read+write) {floor:.2f} ms per request-step")  # fmt: skip
    print(f"{'state, path':<18} {'MiB/req':>8} {'step ms':>8} {'ms/req-step':>11} {'x floor':>8} {'x first':>8}")
    for r in rows:
        mib = r["state_bytes"] / 2**20
        print(f"{r['path']:<18} {mib:>8.1f} {r['step_ms']:>8.1f} {r['ms_per_request_step']:>11.2f} "
              f"{r['vs_floor']:>8.2f} {r['vs_first']:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
