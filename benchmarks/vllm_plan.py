"""vLLM 0.32's own KV cache planner on an HF config.json, as the peer for `hybridkv plan`.

Runs inside the venv made by `benchmarks/setup_vllm_venv.sh`. Only the per-layer specs are built here (a real
vLLM model needs weights); grouping, block counts and concurrency come from vLLM's functions:
`get_kv_cache_configs` and `get_max_concurrency_for_kv_cache_config` (vllm.v1.core.kv_cache_utils).

    python benchmarks/vllm_plan.py --config CFG --memory BYTES --max-model-len 8192 --block-size 16 \
        --max-num-batched-tokens 2048 --dtype bfloat16 [--layout LBNHC|BLHNC|...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

_CACHE_ROOT = tempfile.TemporaryDirectory(prefix="vllm-plan-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", _CACHE_ROOT.name)
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON

import torch  # noqa: E402
from vllm.config import CacheConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_kv_cache_configs,
    get_max_concurrency_for_kv_cache_config,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict[str, Any]) -> list[str]:
    n, model_type = cfg["num_hidden_layers"], cfg.get("model_type", "")
    types = list(cfg.get("layer_types") or [])
    if not types and model_type.startswith(("gemma3", "gemma4")):
        pattern = cfg.get("sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if model_type.startswith("gemma4") and types:
        types[-1] = FULL  # transformers' Gemma4TextConfig forces the last layer to full attention
    types = types or [FULL] * n
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"unsupported layer_types for {n} layers: {sorted(set(types))}")
    return types


def build_specs(cfg: dict[str, Any], block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """One spec per layer that owns KV, as the model runner's get_kv_cache_spec would emit (TP=1)."""
    cfg = cfg.get("text_config") or cfg
    gemma4 = cfg.get("model_type", "").startswith("gemma4")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    types = layer_types(cfg)
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    owners = len(types) - (cfg.get("num_kv_shared_layers") or 0)  # the rest read a target's KV: no spec
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(types[:owners]):
        size, heads = head_dim, kv_heads
        if gemma4 and kind == FULL:
            size = cfg.get("global_head_dim") or 512
            # An absent key is false, as transformers' config field defaults it.
            if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads"):
                heads = cfg["num_global_key_value_heads"]
        size = overrides.get(i, {}).get("head_dim", size)
        heads = overrides.get(i, {}).get("num_key_value_heads", heads)
        common = dict(block_size=block_size, num_kv_heads=heads, head_size=size, dtype=dtype)
        name = f"model.layers.{i}.self_attn.attn"
        if kind == SLIDING:
            specs[name] = SlidingWindowSpec(sliding_window=cfg["sliding_window"], **common)
        else:
            specs[name] = FullAttentionSpec(**common)
    return specs


def make_vllm_config(args: argparse.Namespace) -> VllmConfig:
    cache = CacheConfig(block_size=args.block_size)
    sched = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        is_encoder_decoder=False,
    )
    config = VllmConfig(cache_config=cache, scheduler_config=sched)
    # The planner reads only these ModelConfig fields; a real one would load the checkpoint.
    config.model_config = SimpleNamespace(  # type: ignore[assignment]
        max_model_len=args.max_model_len, original_max_model_len=args.max_model_len
    )
    return config


def kind_of(spec: KVCacheSpec) -> str:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    return {SlidingWindowSpec: "sliding", FullAttentionSpec: "full"}.get(type(spec), type(spec).__name__)


def used_bytes(spec: KVCacheSpec, num_layers: int) -> int:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return sum(s.page_size_bytes for s in spec.kv_cache_specs.values())
    return spec.page_size_bytes * num_layers


def plan(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.config) as f:
        specs = build_specs(json.load(f), args.block_size, getattr(torch, args.dtype))
    config = make_vllm_config(args)
    layout = resolve_kv_cache_layout(config, [[args.layout]], specs.values())
    kv = get_kv_cache_configs(config, [specs], [args.memory])[0]
    groups = [
        {
            "kind": kind_of(g.kv_cache_spec),
            "block_size": g.kv_cache_spec.block_size,
            "layers": [int(name.split(".")[2]) for name in g.layer_names],
        }
        for g in kv.kv_cache_groups
    ]
    bytes_per_block = max(t.size for t in kv.kv_cache_tensors) // kv.num_blocks
    return {
        "num_blocks": kv.num_blocks,
        "max_concurrency": get_max_concurrency_for_kv_cache_config(config, kv),
        "num_groups": len(groups),
        "groups": groups,
        "bytes_per_block": bytes_per_block,
        # bytes of each block that no layer uses, summed over groups (vLLM's "padding layers")
        "padding_bytes_per_block": sum(
            bytes_per_block - used_bytes(g.kv_cache_spec, len(g.layer_names)) for g in kv.kv_cache_groups
        ),
        "layout": layout.name,
        "max_in_flight_tokens": config.max_in_flight_tokens,
        "vllm_version": sys.modules["vllm"].__version__,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="HF config.json")
    p.add_argument("--memory", type=int, required=True, help="KV cache budget in bytes")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="LBNHC", help="KVCacheLayout; LBNHC: vLLM's default, BLHNC: packed")
    args = p.parse_args()
    try:
        result = plan(args)
    except ValueError as e:  # vLLM's "not enough KV cache memory" and friends
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
