"""Side by side: `hybridkv plan` vs vLLM 0.32's KV cache planner, same configs, budgets and limits.

    python benchmarks/plan_vs_vllm.py [--memory 4GiB 16GiB] [--max-model-len 8192 32768] [--configs NAME ..]
        [--vllm-layout BLHNC] [--json]

vLLM runs through benchmarks/vllm_plan.py in its own venv ($VLLM_VENV, default /work/vllm-venv), made by
`bash benchmarks/setup_vllm_venv.sh`; without it only our numbers print. Group summaries read F/S/R (full,
sliding, recurrent state), block size, x number of groups. "conc o/v" and "cons o/v": our max_concurrency and
max_concurrency_conservative over vLLM's max_concurrency.

Recurrent hybrids (qwen3_5, qwen3_next, nemotron_h, granitemoehybrid, bamba): vllm_plan.py builds attention specs
only, so their vLLM numbers come from `vllm_hybrid_rule` below, vLLM 0.32's documented rule recomputed here (no
vLLM code runs), shown in the "vLLM rule" columns with or without a vLLM venv.
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
    "qwen3.5-0.8b",
    "qwen3-next-80b-a3b",
    "nemotron-h-8b",
    "granite-4.0-h-tiny",
]
HYBRID_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_next", "nemotron_h", "granitemoehybrid", "bamba"}
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


def vllm_hybrid_rule(
    config: Path, memory: int, max_model_len: int, block_size: int, dtype: str, kernel_block: int = 16
) -> dict[str, Any]:
    """vLLM 0.32's plan for a recurrent hybrid, from its documented rule (shared/design/ssm-hybrids.md §3;
    Platform._align_hybrid_block_size, docs/design/hybrid_kv_cache_manager.md), recomputed, not run:
    - attn_page_1tok = one token of one attention layer; alignment = max(kernel block, user block);
    - block = alignment * cdiv(state_page, alignment * attn_page_1tok), state_page = one layer's conv + ssm bytes;
    - every page (attention or state) is block * attn_page_1tok bytes (the state padded up to it);
    - layers form groups of `group_size` = the smallest per-type layer count; a block id spans group_size pages;
    - mamba_cache_mode "align" (prefix caching on): a request holds cdiv(max_model_len, block) blocks of its
      attention group(s) and 2 blocks of each state group. Concurrency = num_blocks / blocks per request.
    Same specs as ours (our config reader; state dtypes as ours), TP 1, no speculative blocks."""
    from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf

    m = model_kv_from_hf(load_hf_config(config), block_size=block_size, dtype=dtype)
    attn = [s for s in m.specs if s is not None and not s.per_request_state]
    states = [s for s in m.specs if s is not None and s.per_request_state]
    one_token = max(s.bytes_per_token for s in attn)
    state_page = max(s.conv_bytes + s.ssm_bytes for s in states)
    alignment = max(kernel_block, block_size)
    block = alignment * -(-state_page // (alignment * one_token))
    page = block * one_token
    group_size = min(len(attn), len(states))
    attn_groups, state_groups = -(-len(attn) // group_size), -(-len(states) // group_size)
    num_blocks = memory // (group_size * page)
    per_request = attn_groups * -(-max_model_len // block) + 2 * state_groups
    return {
        "num_blocks": num_blocks,
        "block_size": block,
        "max_concurrency": num_blocks / per_request,
        "groups": f"F{block}x{attn_groups} M{block}x{state_groups}",
        "state_padding": f"{100 * (page - state_page) / state_page:.1f}%",
    }


def ratio(a: Any, b: Any) -> str:
    return f"{a / b:.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=CONFIGS, help="names in examples/configs/ or paths")
    p.add_argument("--memory", nargs="+", default=["4GiB", "16GiB"], help="KV budgets: bytes, or N GiB / MiB")
    p.add_argument("--max-model-len", type=int, nargs="+", default=[8192])
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
        hybrid = json.loads(path.read_text()).get("model_type") in HYBRID_TYPES
        for memory in args.memory:
            for max_len in args.max_model_len:
                common = [
                    "--config", str(path), "--memory", str(parse_bytes(memory)),
                    "--max-model-len", str(max_len), "--block-size", str(args.block_size),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
                ]  # fmt: skip
                ours = [hybridkv, "plan", *common, "--json"] if hybridkv else None
                script = str(ROOT / "benchmarks" / "vllm_plan.py")
                run_vllm = have_vllm and not hybrid
                theirs = [str(vllm_python), script, *common, "--layout", args.vllm_layout] if run_vllm else None
                rule = (path, parse_bytes(memory), max_len) if hybrid else None
                jobs.append((path.stem, memory, max_len, ours, theirs, rule))

    def run(job: tuple) -> dict[str, Any]:
        name, memory, max_len, ours, theirs, rule = job
        return {
            "config": name,
            "memory": memory,
            "max_model_len": max_len,
            "ours": run_json(ours, env) if ours else {"error": "hybridkv missing"},
            "vllm": run_json(theirs, env) if theirs else {},
            "vllm_rule": vllm_hybrid_rule(*rule, args.block_size, args.dtype) if rule else {},
        }

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = list(pool.map(run, jobs))
    shutil.rmtree(env["VLLM_CACHE_ROOT"], ignore_errors=True)

    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    head = ["config", "memory", "len", "ours blocks", "ours conc", "ours conc(cons)", "ours groups"]
    if have_vllm:
        head += ["vLLM blocks", "vLLM conc", "vLLM groups", "blocks o/v", "conc o/v", "cons o/v"]
    any_rule = any(row["vllm_rule"] for row in rows)
    if any_rule:
        head += ["vLLM rule block", "vLLM rule conc", "vLLM rule groups", "state pad", "conc o/rule"]
    table = [head]
    for row in rows:
        ours, theirs, rule = row["ours"], row["vllm"], row["vllm_rule"]
        line = [row["config"], row["memory"], str(row["max_model_len"])]
        if "error" in ours:
            line += [f"error: {ours['error']}"[:60], "", "", ""]
        else:
            line += [fmt(ours["num_blocks"]), fmt(ours["max_concurrency"]),
                     fmt(ours["max_concurrency_conservative"]), groups_summary(ours)]  # fmt: skip
        if have_vllm and "error" in theirs:
            line += [f"error: {theirs['error']}"[:60], "", "", "", "", ""]
        elif have_vllm and theirs:
            line += [fmt(theirs["num_blocks"]), fmt(theirs["max_concurrency"]), groups_summary(theirs),
                     ratio(ours.get("num_blocks"), theirs["num_blocks"]),
                     ratio(ours.get("max_concurrency"), theirs["max_concurrency"]),
                     ratio(ours.get("max_concurrency_conservative"), theirs["max_concurrency"])]  # fmt: skip
        elif have_vllm:
            line += ["(rule)", "", "", "", "", ""]
        if any_rule and rule:
            line += [str(rule["block_size"]), fmt(rule["max_concurrency"]), rule["groups"], rule["state_padding"],
                     ratio(ours.get("max_concurrency"), rule["max_concurrency"])]  # fmt: skip
        elif any_rule:
            line += ["", "", "", "", ""]
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
