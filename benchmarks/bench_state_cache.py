"""Prefix caching of recurrent states, side by side in one run: token hit rate, time to first token and state
checkpoint memory under checkpoint policies (`hybridkv/engine/chunking.py`), on one pool size for all:

  none        no state is cached (hits need a state, so nothing hits: every prompt is computed whole);
  vllm_align  vLLM's "align" mode: states cached only where the token budget ends a prefill chunk, and blocks
              of 512 tokens (vLLM grows the attention block to 400-7,808 tokens to fit a state);
  sglang      SGLang's extra buffer: one checkpoint per prompt, at its last whole 64-token unit (no branch point:
              a shared prefix followed by a longer suffix is missed, sglang#22935);
  chunk_end   our chunk_end policy (align mode with our 16-token blocks);
  prompt_end_lru  ours without the path refresh: checkpoints in plain LRU order (a hit touches only the
              checkpoint it resumes from);
  prompt_end  ours: the branch point off cached history and the prompt's last whole split unit; a hit refreshes
              every cached checkpoint on its path (`PrefixHit.ancestors`); past `--state-cache-memory` the idle
              checkpoint saving the least compute per byte goes (Marconi's rule; every other row drops the least
              recently used, as vLLM and SGLang do);
  turn_end    ours plus turn ends: after each request a background prefill of prompt + answer publishes the
              answer's last whole unit, so the next turn resumes after the answer (`engine/turn_end.py`). It runs
              between requests (a chat's think time), so it is in the trace's total time, not in any TTFT.

Traces (requests run one at a time, sessions interleaved turn by turn; random-weight Qwen3.5, float32):
  chat   C conversations share one system prompt; each has T turns; turn t's prompt is the system prompt, the
         conversation so far (earlier user messages and the model's answers) and a new user message.
  agent  the same with a long system prompt (tool definitions), tool results as user turns, and at every
         `--fork-every`th turn a retried tool call: a sibling request diverges from the same history with another
         tool result, and the session goes on from the retry. `--stagger N`: N sessions join per round, so
         sessions keep arriving while others are deep in their turns (the system prompt's checkpoint must last).

    python benchmarks/bench_state_cache.py [--trace chat|agent] [--stagger 0] [--fork-every 2] [--policies ...]
        [--shape tiny] [--conversations 4] [--turns 4]
        [--system 512] [--user 96] [--answer 32] [--threads 1] [--max-num-batched-tokens 2048] [--json]
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

POLICIES = ("none", "vllm_align", "sglang", "chunk_end", "prompt_end_lru", "prompt_end", "turn_end")
ENGINE = {  # policy -> engine options
    "none": dict(state_checkpoints="none"),
    "vllm_align": dict(state_checkpoints="chunk_end", block_size=512),
    "sglang": dict(state_checkpoints="last_unit"),
    "chunk_end": dict(state_checkpoints="chunk_end"),
    "prompt_end_lru": dict(state_checkpoints="prompt_end"),
    "prompt_end": dict(state_checkpoints="prompt_end"),
    "turn_end": dict(state_checkpoints="turn_end"),
}


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[tuple[int, list[int], bool]]]:
    """The system prompt and the requests in order: (session, new user tokens, whether the session goes on
    from this request's answer; a forked sibling does not)."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    system = tokens(args.system)
    start = [c // args.stagger if args.stagger else 0 for c in range(args.conversations)]  # the round c joins in
    requests = []
    for r in range(max(start) + args.turns):
        for c in range(args.conversations):
            t = r - start[c]  # session c's turn in round r
            if not 0 <= t < args.turns:
                continue
            if args.trace == "agent" and args.fork_every and t % args.fork_every == args.fork_every - 1:
                requests.append((c, tokens(args.user), False))  # the tool call that is retried
            requests.append((c, tokens(args.user), True))
    return system, requests


def run(folder: Path, policy: str, args: argparse.Namespace) -> dict:
    from hybridkv import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype="float32", kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, state_cache_memory=args.state_cache_memory,
        **ENGINE[policy],
    )  # fmt: skip
    engine = llm.engine
    if policy not in ("prompt_end", "turn_end"):  # baselines: no path refresh; the bound drops the least recent
        engine.kv.pool.refresh = lambda blocks: None
        engine.kv.pool.checkpoint_victim = "lru"
    system, requests = workload(args, engine.vocab_size)
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.answer, temperature=0, ignore_eos=True)
    ttft, hit, prompt_tokens, peak = [], 0, 0, 0
    began = time.perf_counter()
    for c, user, goes_on in requests:
        prompt = history[c] + user
        before = engine.scheduler.stats.prefix_hit_tokens
        req = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        ttft.append(req.first_token_time - req.arrival_time)
        hit += engine.scheduler.stats.prefix_hit_tokens - before
        prompt_tokens += len(prompt)
        peak = max(peak, checkpoint_bytes(engine))
        if goes_on:
            history[c] = prompt + req.output_token_ids
    return {
        "policy": policy,
        "requests": len(ttft),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit,
        "hit_rate": hit / prompt_tokens,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
        "state_checkpoint_bytes": checkpoint_bytes(engine),
        "state_checkpoint_peak_bytes": peak,
        "pool_bytes": engine.plan.total_bytes,
        "total_s": time.perf_counter() - began,
    }


def checkpoint_bytes(engine) -> int:
    """Pool bytes the cached state entries (checkpoints) take now."""
    state = engine.plan.state
    entries = sum(1 for (_, gid) in engine.kv.pool.cached if gid == state.group)
    return entries * state.bytes_per_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="chat", choices=("chat", "agent"))
    ap.add_argument("--fork-every", type=int, default=2, help="agent trace: a retried tool call every Nth turn")
    ap.add_argument("--stagger", type=int, default=0, help="sessions joining per round (0: all in the first)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--shape", default="tiny", choices=sorted(hybrid_models.SHAPES))
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user", type=int, default=96)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="512MiB", help="the pool, the same for every policy")
    ap.add_argument(
        "--state-cache-memory",
        default=None,
        help="bound on idle state checkpoints, the same for every policy (default: the pool only)",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse a built checkpoint here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model_dir or Path(tempfile.gettempdir()) / f"hybridkv-bench-qwen3_5-{args.shape}"
    hybrid_models.build(folder, args.shape)
    start = time.perf_counter()
    rows = [run(folder, policy, args) for policy in args.policies]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    base = rows[0]["ttft_mean_s"]
    n = rows[0]["requests"]
    print(f"{args.trace} trace: {args.conversations} sessions x {args.turns} turns ({n} requests), system prompt "
          f"{args.system}, user {args.user}, answer {args.answer} tokens; Qwen3.5 {args.shape} random, float32, "
          f"{args.threads} thread(s), pool {args.kv_cache_memory}, idle checkpoints <= "
          f"{args.state_cache_memory or 'the pool'}")  # fmt: skip
    print(f"{'policy':<14} {'hit rate':>8} {'hit tok':>8} {'TTFT mean':>10} {'p50':>8} {'max':>8} {'vs none':>8} "
          f"{'ckpt MiB':>9} {'peak':>7} {'total s':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['policy']:<14} {r['hit_rate']:>8.1%} {r['hit_tokens']:>8} {r['ttft_mean_s'] * 1e3:>8.1f}ms "
              f"{r['ttft_p50_s'] * 1e3:>6.1f}ms {r['ttft_max_s'] * 1e3:>6.1f}ms {base / r['ttft_mean_s']:>7.2f}x "
              f"{r['state_checkpoint_bytes'] / 2**20:>9.2f} "
              f"{r['state_checkpoint_peak_bytes'] / 2**20:>7.2f} {r['total_s']:>8.1f}")  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
