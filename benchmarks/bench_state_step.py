"""Decode steps of a recurrent hybrid whose time is its states: Qwen3.5-0.8B's state layout (18 Gated DeltaNet
layers, 16 heads of 128 x 128, float32: 18.7 MiB per request) with tiny compute (hidden 64, vocab 512), a batch
of decoding requests, against the floor of reading and writing every state once at this process's measured copy
bandwidth. Side by side in one run: states stepped in the pool (the native kernel) and the torch path (each
state gathered into a copy, stepped by `gated_delta_step` and written back).

    python benchmarks/bench_state_step.py [--batch 32] [--prompt 64] [--steps 12] [--threads 1] [--json]

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


def decode_steps(folder: Path, args: argparse.Namespace, in_pool: bool) -> dict:
    from hybridkv import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype="float32", kv_cache_memory=args.memory, max_model_len=1024, max_num_seqs=args.batch,
        max_num_batched_tokens=2048, enable_prefix_caching=False,
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
        "path": "in pool" if in_pool else "gathered copies",
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = hybrid_models.build(Path(tmp) / "state-0.8b", "state-0.8b")
        rows = [decode_steps(folder, args, in_pool=True), decode_steps(folder, args, in_pool=False)]
    state = rows[0]["state_bytes"]
    floor = copy_floor(state * args.batch) / args.batch * 1e3
    for r in rows:
        r["floor_ms"] = floor
        r["vs_floor"] = r["ms_per_request_step"] / floor
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    gbps = 2 * state / (floor / 1e3) / 1e9
    print(f"state {state / 2**20:.1f} MiB/request, batch {args.batch}, {args.threads} thread(s); floor (read + write "
          f"once, copy bandwidth {gbps:.1f} GB/s read+write) {floor:.2f} ms per request-step")  # fmt: skip
    print(f"{'path':<16} {'step ms':>8} {'ms/req-step':>11} {'x floor':>8}")
    for r in rows:
        print(f"{r['path']:<16} {r['step_ms']:>8.1f} {r['ms_per_request_step']:>11.2f} {r['vs_floor']:>8.2f}")


if __name__ == "__main__":
    main()
