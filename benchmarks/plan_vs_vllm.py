"""Side by side: `hybridkv plan` vs vLLM 0.32's KV cache planner, same configs, budgets and limits.

    python benchmarks/plan_vs_vllm.py [--memory 4GiB 16GiB] [--configs NAME ..] [--vllm-layout BLHNC] [--json]

vLLM runs through benchmarks/vllm_plan.py in its own venv ($VLLM_VENV, default /work/vllm-venv), made by
`bash benchmarks/setup_vllm_venv.sh`; without it only our numbers print. Group summaries read F/S (full or
sliding), block size, x number of groups. "conc o/v" and "cons o/v": our max_concurrency and
max_concurrency_conservative over vLLM's max_concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    "llama-3-8b",
    "gemma3-27b-like",
    "gpt-oss-20b-like",
    "gemma4-e2b-like",
    "gemma4-e4b-like-multimodal",
    "gemma4-31b-like",
]
UNITS = {"GiB": 1 << 30, "MiB": 1 << 20}


def parse_bytes(text: str) -> int:
    for suffix, scale in UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def run_json(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        message = " ".join((proc.stderr or proc.stdout).split()).removeprefix("error: ")
        return {"error": message or f"exit {proc.returncode}"}


def groups_summary(result: dict[str, Any]) -> str:
    counts = Counter((str(g["kind"])[0].upper(), g["block_size"]) for g in result.get("groups", []))
    return " ".join(f"{kind}{bs}x{n}" for (kind, bs), n in sorted(counts.items()))


def ratio(a: Any, b: Any) -> str:
    return f"{a / b:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=CONFIGS, help="names in examples/configs/ or paths")
    p.add_argument("--memory", nargs="+", default=["4GiB", "16GiB"], help="KV budgets: bytes, or N GiB / MiB")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-layout", default="LBNHC", help="vLLM KVCacheLayout; BLHNC: its packed planner")
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    p.add_argument("--json", action="store_true", help="print the raw results as one JSON list")
    args = p.parse_args()

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="vllm-cache-"))
    vllm_python = Path(args.vllm_venv) / "bin" / "python"
    have_vllm = vllm_python.exists()
    if not have_vllm:
        print(f"no vLLM venv at {args.vllm_venv}; create it with: bash benchmarks/setup_vllm_venv.sh")
        print("showing hybridkv only\n")
    hybridkv = shutil.which("hybridkv")
    if hybridkv is None:
        print("`hybridkv` is not on PATH: `pip install -e .` first", file=sys.stderr)

    jobs = []
    for name in args.configs:
        path = Path(name) if name.endswith(".json") else ROOT / "examples" / "configs" / f"{name}.json"
        for memory in args.memory:
            common = [
                "--config", str(path), "--memory", str(parse_bytes(memory)),
                "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
            ]  # fmt: skip
            ours = [hybridkv, "plan", *common, "--json"] if hybridkv else None
            script = str(ROOT / "benchmarks" / "vllm_plan.py")
            theirs = [str(vllm_python), script, *common, "--layout", args.vllm_layout] if have_vllm else None
            jobs.append((path.stem, memory, ours, theirs))

    def run(job: tuple[str, str, list[str] | None, list[str] | None]) -> dict[str, Any]:
        name, memory, ours, theirs = job
        return {
            "config": name,
            "memory": memory,
            "ours": run_json(ours, env) if ours else {"error": "hybridkv missing"},
            "vllm": run_json(theirs, env) if theirs else {},
        }

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = list(pool.map(run, jobs))
    shutil.rmtree(env["VLLM_CACHE_ROOT"], ignore_errors=True)

    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = ["config", "memory", "ours blocks", "ours conc", "ours conc(cons)", "ours groups"]
    if have_vllm:
        head += ["vLLM blocks", "vLLM conc", "vLLM groups", "blocks o/v", "conc o/v", "cons o/v"]
    table = [head]
    for row in rows:
        ours, theirs = row["ours"], row["vllm"]
        line = [row["config"], row["memory"]]
        if "error" in ours:
            line += [f"error: {ours['error']}"[:60], "", "", ""]
        else:
            line += [fmt(ours["num_blocks"]), fmt(ours["max_concurrency"]),
                     fmt(ours["max_concurrency_conservative"]), groups_summary(ours)]  # fmt: skip
        if have_vllm and "error" in theirs:
            line += [f"error: {theirs['error']}"[:60], "", "", "", "", ""]
        elif have_vllm:
            line += [fmt(theirs["num_blocks"]), fmt(theirs["max_concurrency"]), groups_summary(theirs),
                     ratio(ours.get("num_blocks"), theirs["num_blocks"]),
                     ratio(ours.get("max_concurrency"), theirs["max_concurrency"]),
                     ratio(ours.get("max_concurrency_conservative"), theirs["max_concurrency"])]  # fmt: skip
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
