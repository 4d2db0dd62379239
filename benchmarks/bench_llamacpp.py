"""Decode speed against llama.cpp and the bandwidth bound, same run, one checkpoint: Qwen3.5-0.8B's shapes in
bfloat16 (random weights, `hybrid_models.py`), converted to GGUF with llama.cpp's own converter.

Cases, each alternating engine by engine `--repeats` times (best kept):
- single: one 128-token prompt, then 64 decode steps (llama-bench `-p 0 -n 64 -d 128`);
- batched: 16 prompts x 128 tokens, 64 decode steps each (llama-batched-bench `-npp 128 -ntg 64 -npl 16`, its
  S_TG column).
Decode tok/s counts the tokens after the prompt's first one, over the time after it. The bounds: single stream,
the bytes one decode step must read (every projection's weight and the tied logits table, `layout_bytes` of the
packed bf16 weights) at this process's measured read bandwidth (a 512 MiB sum, best of three); batched, the
projections' arithmetic (2 FLOP per weight per token) at this process's best bf16 matmul rate (`matmul_peak`).

Needs llama.cpp's two benchmark tools, built from `llama-cpp-python`'s vendored tree by
`bash benchmarks/setup_llama_cpp.sh` (once per machine; it prints the tree to pass):

    python benchmarks/bench_llamacpp.py --llama-cpp DIR [--models /tmp/models] [--threads 1] [--repeats 3] \
        [--cases single,batched]   # DIR: the tree setup_llama_cpp.sh printed
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
PROMPT, NEW, BATCH = 128, 64, 16


def matmul_peak() -> float:
    """FLOP/s of this process's best bf16 matmul, the way the engine runs one here: oneDNN on a packed [8192, 1024]
    weight, or on a CPU oneDNN packs no bfloat16 for (AVX2) the weight widened to float32 (`widened.py`); a 512-row
    input, best of five (the arithmetic bound of a batched decode step: 2 x params FLOP per row)."""
    from hybridkv.models.packed_rows import PackedWeight
    from hybridkv.models.widened import WidenedWeight, widening_wanted

    weight = torch.randn(8192, 1024).bfloat16()
    if widening_wanted(torch.device("cpu"), torch.bfloat16):
        widened = WidenedWeight(weight)
        run = lambda x: widened(x, None)  # noqa: E731
    else:
        packed = PackedWeight(weight)
        run = lambda x: packed.onednn(x, None)  # noqa: E731
    x = torch.randn(512, 1024).bfloat16()
    run(x)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        run(x)
        best = min(best, time.perf_counter() - t)
    return 2 * 512 * 8192 * 1024 / best


def step_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a decode step reads: every projection (the tied head included) in the layout it is read
    in, oneDNN's packed one (`layout_bytes`) or the checkpoint's own bf16 rows (`WidenedWeight`)."""
    from hybridkv.models.packed_rows import PackedWeight, layout_bytes
    from hybridkv.serve.startup import linear_readers

    readers = linear_readers(model)
    if not readers:
        raise SystemExit("the model's projections are neither packed nor widened (bfloat16 here?): no bound")
    return sum(
        layout_bytes(r.out_features, r.in_features) if isinstance(r, PackedWeight) else r.weight.numel() * 2
        for r in readers
    )


class Ours:
    def __init__(self, folder: Path) -> None:
        from hybridkv.engine.llm import LLM
        from hybridkv.request.sampling_params import SamplingParams

        self.llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=PROMPT + NEW + 16,
                       enable_prefix_caching=False)  # fmt: skip
        self.params = SamplingParams(max_tokens=NEW + 1, temperature=0, ignore_eos=True)
        self.rng = random.Random(0)

    def decode_rate(self, batch: int) -> float:
        """Decode tok/s of `batch` fresh prompts: tokens after each prompt's first, over the time after them."""
        engine = self.llm.engine
        vocab = engine.vocab_size
        reqs = [engine.add_request([self.rng.randrange(4, vocab) for _ in range(PROMPT)], self.params)
                for _ in range(batch)]  # fmt: skip
        while not all(r.output_token_ids for r in reqs):
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return batch * NEW / (time.perf_counter() - start)


def llama_single(bin_dir: Path, model: Path, threads: int) -> float:
    args = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(NEW),
            "-d", str(PROMPT), "-r", "1", "-o", "json"]  # fmt: skip
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["avg_ts"]


def llama_batched(bin_dir: Path, model: Path, threads: int) -> float:
    args = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
            "-c", "4096", "-npp", str(PROMPT), "-ntg", str(NEW), "-npl", str(BATCH),
            "--output-format", "jsonl"]  # fmt: skip
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows[-1]["speed_tg"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/bin tools")
    ap.add_argument("--models", type=Path, default=None, help="folder to keep the checkpoint and GGUF in")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="single,batched")
    args = ap.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    if not (bin_dir / "llama-bench").exists():
        raise SystemExit(f"no {bin_dir / 'llama-bench'}: run benchmarks/setup_llama_cpp.sh first")
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from bounds import read_bandwidth
    from hybrid_models import build
    from llamacpp_engine import gguf

    with tempfile.TemporaryDirectory() as tmp:
        folder = build((args.models or Path(tmp)) / "qwen3.5-0.8b", "0.8b")
        model = gguf(args.llama_cpp, folder, "bfloat16")
        ours = Ours(folder)
        weights = step_bytes(ours.llm.engine.model)
        bound = read_bandwidth() / weights  # single-stream decode tok/s at most
        peak = matmul_peak()
        compute = peak / weights  # tok/s at most in any batch: 2 FLOP per 2-byte weight per token
        print(
            f"CPU {cpu_name()}, {args.threads} thread(s); bound {bound:.2f} tok/s single stream (weights at the "
            f"read bandwidth), {compute:.1f} tok/s batched (projections at the bf16 matmul peak, "
            f"{peak / 1e9:.0f} GFLOP/s)"
        )
        runs = {"single": (1, llama_single), "batched": (BATCH, llama_batched)}
        print(f"{'case':<10}{'hybridkv':>12}{'llama.cpp':>12}{'ratio':>9}{'hkv/bound':>11}{'llama/bound':>13}")
        for case in args.cases.split(","):
            batch, theirs = runs[case]
            best_ours = best_theirs = 0.0
            for _ in range(args.repeats):
                best_ours = max(best_ours, ours.decode_rate(batch))
                best_theirs = max(best_theirs, theirs(bin_dir, model, args.threads))
            limit = bound if batch == 1 else compute
            share = f"{best_ours / limit:>10.0%} {best_theirs / limit:>12.0%}"
            print(f"{case:<10}{best_ours:>12.2f}{best_theirs:>12.2f}{best_ours / best_theirs:>8.2f}x {share}")


if __name__ == "__main__":
    main()
