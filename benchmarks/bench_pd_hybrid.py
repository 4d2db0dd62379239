"""PD on a recurrent hybrid, side by side in one run: TTFT through the proxy vs one instance, the bytes the
decoder read per request against what it needs (the attention KV of the prompt's first P - 1 tokens, whole
blocks, plus one state: every recurrent layer's conv and recurrent state, as pages), packed vs per-layer, and
the size of the signed kv_transfer_params a prefill hands out (JSON bytes).

    python benchmarks/bench_pd_hybrid.py [--shape tiny] [--lengths 1024 4096] [--repeats 3]

Model: a random-weight Qwen3.5 (benchmarks/hybrid_models.py), float32; every prompt is fresh random ids, so no
prefix cache helps. Prefill, decode and proxy each get one torch thread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import hybrid_models

sys.path.insert(0, str(Path(__file__).parents[1]))
import httpx

from benchmarks.bench_pd import connector, serve, ttft
from tests.procs import Process


def needed_bytes(folder: Path, length: int) -> tuple[int, int]:
    """(attention KV bytes of the blocks holding tokens [0, length - 1), bytes of one request's state pages)."""
    from hybridkv.kv.model_kv import load_hf_config
    from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

    plan = plan_from_hf_config(load_hf_config(folder), CacheConfig(1 << 30, 32768), dtype="float32")
    blocks = -(-(length - 1) // plan.block_size)
    kv = sum(blocks * g.used_bytes_per_block for g in plan.groups if not g.is_state)
    return kv, plan.state.bytes_per_request


def params_bytes(prefill: Process, decode: Process, prompt: list[int]) -> int:
    """JSON bytes of the kv_transfer_params `prefill` hands out for `prompt` (the decoder then consumes them)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{prefill.url}/v1/completions", json=body | {"kv_transfer_params": {"do_remote_decode": True}},
                     timeout=600).json()["kv_transfer_params"]  # fmt: skip
    httpx.post(f"{decode.url}/v1/completions", json=body | {"kv_transfer_params": out}, timeout=600).raise_for_status()
    return len(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(hybrid_models.SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    max_len = max(args.lengths) + 64
    folder = hybrid_models.build(Path(tempfile.gettempdir()) / f"hybridkv-bench-qwen3_5-{args.shape}", args.shape)
    vocab = hybrid_models.SHAPES[args.shape]["vocab_size"]
    rows = []
    for layout in ("packed", "per-layer"):
        p, d = serve(folder, layout, max_len), serve(folder, layout, max_len)
        x = Process("proxy", "--prefill", p.url, "--decode", d.url)
        try:
            ttft(x.url, [rng.randrange(4, vocab) for _ in range(64)])  # warm-up, handshake
            for length in args.lengths:
                one, pd, moved = [], [], []
                for _ in range(args.repeats):
                    one.append(ttft(p.url, [rng.randrange(4, vocab) for _ in range(length)]))
                    before = connector(d)
                    pd.append(ttft(x.url, [rng.randrange(4, vocab) for _ in range(length)]))
                    after = connector(d)
                    delta = {
                        k: after[k] - before[k] for k in ("kv_transfer_bytes_total", "kv_transfer_descriptors_total")
                    }
                    moved.append((delta["kv_transfer_bytes_total"], delta["kv_transfer_descriptors_total"]))
                sent = params_bytes(p, d, [rng.randrange(4, vocab) for _ in range(length)])
                rows.append((layout, length, statistics.median(one), statistics.median(pd), moved[-1], sent))
        finally:
            for proc in (x, p, d):
                proc.stop()
    print(f"Qwen3.5 {args.shape} random, float32; per request: bytes read by the decoder vs needed (KV + state)")
    head = (
        "layout",
        "prompt",
        "TTFT one",
        "TTFT PD",
        "ratio",
        "MB moved",
        "KV MB",
        "state MB",
        "moved/need",
        "descs",
        "params B",
    )
    print("".join(f"{h:>11}" for h in head))
    for layout, length, one, pd, (nbytes, descs), sent in rows:
        kv, state = needed_bytes(folder, length)
        print(f"{layout:>11}{length:>11}{one * 1e3:>9.0f}ms{pd * 1e3:>9.0f}ms{pd / one:>11.2f}{nbytes / 1e6:>11.3f}"
              f"{kv / 1e6:>11.3f}{state / 1e6:>11.3f}{nbytes / (kv + state):>11.3f}{descs:>11.0f}"
              f"{sent:>11}")  # fmt: skip


if __name__ == "__main__":
    main()
