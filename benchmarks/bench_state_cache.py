"""Prefix caching of recurrent states on a multi-turn chat workload, side by side in one run: token hit rate and
time to first token under three checkpoint policies (`hybridkv/engine/chunking.py`):

  none        no state is cached (hits need a state, so nothing hits: every prompt is computed whole);
  chunk_end   a state is cached only where the token budget ends a prefill chunk (vLLM's "align" mode);
  prompt_end  ours: also at a prompt's branch point off cached history and at its last whole split unit.

Workload: C conversations share one system prompt; each has T turns; turn t's prompt is the system prompt, the
conversation so far (earlier user messages and the model's answers) and a new user message. Requests run one at a
time, turn by turn across conversations (c0 t0, c1 t0, ..., c0 t1, ...), on a random-weight Qwen3.5 (float32).

    python benchmarks/bench_state_cache.py [--shape tiny] [--conversations 4] [--turns 4] [--system 512]
        [--user 96] [--answer 32] [--threads 1] [--max-num-batched-tokens 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import hybrid_models
import torch

POLICIES = ("none", "chunk_end", "prompt_end")


def workload(args: argparse.Namespace, vocab: int):
    rng = random.Random(0)
    system = [rng.randrange(4, vocab) for _ in range(args.system)]
    users = [
        [[rng.randrange(4, vocab) for _ in range(args.user)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    return system, users


def run(folder: Path, policy: str, args: argparse.Namespace) -> dict:
    from hybridkv import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype="float32", kv_cache_memory=args.kv_cache_memory, max_model_len=8192,
        max_num_batched_tokens=args.max_num_batched_tokens, state_checkpoints=policy,
    )  # fmt: skip
    engine = llm.engine
    system, users = workload(args, engine.vocab_size)
    history = [list(system) for _ in users]
    params = SamplingParams(max_tokens=args.answer, temperature=0, ignore_eos=True)
    ttft, hit, prompt_tokens = [], 0, 0
    for t in range(args.turns):
        for c, turns in enumerate(users):
            prompt = history[c] + turns[t]
            before = engine.scheduler.stats.prefix_hit_tokens
            req = engine.add_request(prompt, params)
            while engine.has_unfinished():
                engine.step()
            ttft.append(req.first_token_time - req.arrival_time)
            hit += engine.scheduler.stats.prefix_hit_tokens - before
            prompt_tokens += len(prompt)
            history[c] = prompt + req.output_token_ids
    pool = engine.kv.pool
    state_groups = [g.group_id for g in engine.plan.groups if g.is_state_page]
    cached_state = sum(1 for (_, gid) in pool.cached if gid in state_groups)
    return {
        "policy": policy,
        "requests": len(ttft),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit,
        "hit_rate": hit / prompt_tokens,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "state_checkpoint_bytes": cached_state * engine.plan.bytes_per_block,
        "pool_bytes": engine.plan.total_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(hybrid_models.SHAPES))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user", type=int, default=96)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse a built checkpoint here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model_dir or Path(tempfile.gettempdir()) / f"hybridkv-bench-qwen3_5-{args.shape}"
    hybrid_models.build(folder, args.shape)
    start = time.perf_counter()
    rows = [run(folder, policy, args) for policy in POLICIES]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    base = rows[0]["ttft_mean_s"]
    print(f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system}, user {args.user}, "
          f"answer {args.answer} tokens; Qwen3.5 {args.shape} random, float32, {args.threads} thread(s)")  # fmt: skip
    print(f"{'policy':<11} {'hit rate':>8} {'hit tok':>8} {'TTFT mean':>10} {'p50':>8} {'max':>8} {'vs none':>8} "
          f"{'ckpt MiB':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['policy']:<11} {r['hit_rate']:>8.1%} {r['hit_tokens']:>8} {r['ttft_mean_s'] * 1e3:>8.1f}ms "
              f"{r['ttft_p50_s'] * 1e3:>6.1f}ms {r['ttft_max_s'] * 1e3:>6.1f}ms {base / r['ttft_mean_s']:>7.2f}x "
              f"{r['state_checkpoint_bytes'] / 2**20:>9.2f}")  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
