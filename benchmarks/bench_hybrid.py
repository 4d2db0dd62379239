"""Recurrent hybrids, side by side in one run: time to first token and decode tokens/s of one request with a
1k- and a 4k-token prompt, hybridkv vs transformers (its own cache: chunked GDN scan for the prompt, recurrent
step per token), on a random-weight Qwen3.5 `tiny` and `0.8b`-shaped model (benchmarks/hybrid_models.py),
float32. Best of `--repeats`, engines alternating (the machines are shared and noisy).

vLLM-cpu is not in this table: the PyPI vLLM wheel is a CUDA build, and vLLM's CPU backend does not run Gated
DeltaNet layers (its GDN kernels are Triton/CUDA); see the closing notes of issue 15.

    python benchmarks/bench_hybrid.py [--shapes tiny 0.8b] [--lengths 1024 4096] [--new-tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import hybrid_models
import torch


def hf_run(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s): the prompt in one forward with a cache, then greedy tokens one at a time."""
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    t1 = time.perf_counter()
    cache = out.past_key_values
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return t1 - t0, (new_tokens - 1) / (t2 - t1)


def ours_run(llm, ids: list[int], new_tokens: int) -> tuple[float, float]:
    from hybridkv import SamplingParams

    engine = llm.engine
    req = engine.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    end = time.monotonic()
    return req.first_token_time - req.arrival_time, (new_tokens - 1) / (end - req.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["tiny", "0.8b"], choices=sorted(hybrid_models.SHAPES))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from hybridkv import LLM

    print(f"{'model':<6} {'prompt':>6} | {'TTFT ours':>10} {'TTFT HF':>9} {'HF/ours':>7} | {'tok/s ours':>10} "
          f"{'tok/s HF':>9} {'ours/HF':>7}")  # fmt: skip
    for shape in args.shapes:
        folder = hybrid_models.build(Path(tempfile.gettempdir()) / f"hybridkv-bench-qwen3_5-{shape}", shape)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        llm = LLM(str(folder), dtype="float32", max_model_len=8192, kv_cache_memory="2GiB",
                  max_num_batched_tokens=8192, enable_prefix_caching=False)  # fmt: skip
        vocab = llm.engine.vocab_size
        for length in args.lengths:
            ids = [random.Random(length).randrange(4, vocab) for _ in range(length)]
            best_ours, best_hf = (float("inf"), 0.0), (float("inf"), 0.0)
            for _ in range(args.repeats):
                with torch.inference_mode():
                    t, r = hf_run(hf, ids, args.new_tokens)
                best_hf = (min(best_hf[0], t), max(best_hf[1], r))
                t, r = ours_run(llm, ids, args.new_tokens)
                best_ours = (min(best_ours[0], t), max(best_ours[1], r))
            (ttft, rate), (hf_ttft, hf_rate) = best_ours, best_hf
            print(f"{shape:<6} {length:>6} | {ttft:>9.2f}s {hf_ttft:>8.2f}s {hf_ttft / ttft:>6.2f}x"
                  f" | {rate:>10.1f} {hf_rate:>9.1f} {rate / hf_rate:>6.2f}x", flush=True)  # fmt: skip
        del hf, llm


if __name__ == "__main__":
    main()
