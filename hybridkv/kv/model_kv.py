"""Turn a Hugging Face `config.json` into what each layer needs from the KV cache.

A reader returns one entry per layer: a `LayerAttn` (attention), a `LayerState` (a recurrent layer: Gated
DeltaNet, Mamba2) or None (a layer that keeps nothing: Nemotron-H's MLP and MoE layers), plus the KV-sharing
map. Layers that share another layer's KV (Gemma 4's last `num_kv_shared_layers`) get no spec: they map to a
target. The recurrent hybrids' readers are in `hybrid_configs.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hybridkv.kv.hybrid_configs import HYBRID_READERS
from hybridkv.kv.kinds import cache_kind
from hybridkv.kv.layers import LayerAttn, head_dim, kv_heads
from hybridkv.kv.spec import KVSpec, resolve_dtype
from hybridkv.kv.state import STATE_DTYPES, LayerState

__all__ = ["MODEL_READERS", "LayerAttn", "LayerState", "ModelKV", "load_hf_config", "model_kv_from_hf"]


@dataclass(frozen=True)
class ModelKV:
    """Per-layer KV specs. `specs[i] is None` exactly when layer i reads `shared[i]`'s KV or keeps nothing
    (i in `stateless`)."""

    model_type: str
    specs: tuple[KVSpec | None, ...]
    shared: Mapping[int, int] = field(default_factory=dict)
    stateless: frozenset[int] = frozenset()  # layers with no cache at all (MLP/MoE blocks of Nemotron-H)

    def __post_init__(self) -> None:
        for consumer, target in self.shared.items():
            if not 0 <= target < consumer < len(self.specs):
                raise ValueError(f"layer {consumer} must share the KV of an earlier layer, not {target}")
            if self.specs[consumer] is not None or self.specs[target] is None:
                raise ValueError(f"layer {consumer} shares layer {target}: it must have no spec, its target one")
            if self.specs[target].per_request_state:
                raise ValueError(f"layer {consumer} shares layer {target}, which keeps a recurrent state, not KV")
        for i in sorted(self.stateless):
            if not 0 <= i < len(self.specs) or self.specs[i] is not None or i in self.shared:
                raise ValueError(f"stateless layer {i} must be a layer with no spec and no KV-sharing target")
        missing = [
            i for i, s in enumerate(self.specs) if s is None and i not in self.shared and i not in self.stateless
        ]
        if missing:
            raise ValueError(f"layers {missing} have neither a KV spec, a KV-sharing target, nor are stateless")

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def owners(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s is not None]


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read `config.json` from a file or a model folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no config.json at {path}: pass a config.json file or a model folder that has one")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from e


_head_dim, _kv_heads = head_dim, kv_heads


_LAYER_KINDS = {"full_attention": "full_attention", "sliding_attention": "sliding_window"}


def _from_layer_types(cfg: Mapping[str, Any], layer_types: list[str]) -> list[LayerAttn]:
    if len(layer_types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {cfg['num_hidden_layers']} layers")
    layers = []
    for i, t in enumerate(layer_types):
        if t not in _LAYER_KINDS:
            raise ValueError(f"layer {i} has unsupported type {t!r}; supported: {', '.join(_LAYER_KINDS)}")
        kind = _LAYER_KINDS[t]
        window = cfg.get("sliding_window") if kind == "sliding_window" else None
        if kind == "sliding_window" and not window:
            raise ValueError(f"layer {i} is sliding_attention but the config has no sliding_window")
        layers.append(LayerAttn(kind, _kv_heads(cfg), _head_dim(cfg), window))
    return layers


def _dense(cfg: Mapping[str, Any]) -> tuple[list[LayerAttn], dict[int, int]]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        sliding_from = cfg.get("max_window_layers", n) if cfg.get("use_sliding_window") else n
        types = ["sliding_attention" if i >= sliding_from else "full_attention" for i in range(n)]
    return _from_layer_types(cfg, types), {}


def _mistral(cfg: Mapping[str, Any]) -> tuple[list[LayerAttn], dict[int, int]]:
    types = cfg.get("layer_types")
    if types is None:  # a sliding_window slides every layer
        kind = "sliding_attention" if cfg.get("sliding_window") else "full_attention"
        types = [kind] * cfg["num_hidden_layers"]
    return _from_layer_types(cfg, types), {}


# Gemma3TextConfig's defaults for the fields that size the cache (not the generic hidden / heads fallback).
GEMMA3_SHAPE_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4}


def _gemma3(cfg: Mapping[str, Any]) -> tuple[list[LayerAttn], dict[int, int]]:
    cfg = {**GEMMA3_SHAPE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])
        ]
    return _from_layer_types(cfg, types), {}


def _gpt_oss(cfg: Mapping[str, Any]) -> tuple[list[LayerAttn], dict[int, int]]:
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return _from_layer_types(cfg, types), {}


def gemma4_kv_targets(layer_types: list[str], num_kv_shared_layers: int) -> dict[int, int]:
    """Consumer -> target: each of the last `num_kv_shared_layers` layers reads the KV of the last earlier
    non-consumer layer of its own type. Computed here because configs older than transformers 5.24 lack
    `kv_sharing_modes`."""
    n = len(layer_types)
    first_shared = n - num_kv_shared_layers
    if num_kv_shared_layers <= 0:
        return {}
    if first_shared <= 0:
        raise ValueError(f"num_kv_shared_layers={num_kv_shared_layers} leaves no layer to own KV ({n} layers)")
    last_owner = {t: i for i, t in enumerate(layer_types[:first_shared])}
    targets = {}
    for i in range(first_shared, n):
        if layer_types[i] not in last_owner:
            raise ValueError(f"KV-sharing layer {i} ({layer_types[i]}) has no earlier layer of its type to read")
        targets[i] = last_owner[layer_types[i]]
    return targets


def _gemma4(cfg: Mapping[str, Any]) -> tuple[list[LayerAttn], dict[int, int]]:
    if "text_config" in cfg:
        cfg = cfg["text_config"]
    n = cfg["num_hidden_layers"]
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {n!r}")
    types = list(cfg.get("layer_types") or [])
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types[-1] = "full_attention"  # Gemma 4 forces its last layer to full attention.
    overrides = cfg.get("per_layer_config")
    if overrides is None:  # Written by transformers < 5.24: global_* fields instead of per-layer overrides.
        full: dict[str, int] = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    # transformers writes the keys as zero-padded strings ("07" once there are 10+ layers).
    by_layer = {int(k): v for k, v in overrides.items()}
    layers = []
    for i, base in enumerate(_from_layer_types(cfg, types)):
        o = by_layer.get(i, {})
        heads = o.get("num_key_value_heads", base.num_kv_heads)
        layers.append(LayerAttn(base.kind, heads, o.get("head_dim", base.head_size), base.sliding_window))
    return layers, gemma4_kv_targets(types, cfg.get("num_kv_shared_layers", 0))


Reader = Callable[[Mapping[str, Any]], tuple[list[LayerAttn | LayerState | None], dict[int, int]]]
MODEL_READERS: dict[str, Reader] = {
    "llama": _dense,
    "qwen3": _dense,
    "qwen2": _dense,
    "mistral": _mistral,
    "gemma3_text": _gemma3,
    "gpt_oss": _gpt_oss,
    "gemma4_text": _gemma4,
    "gemma4": _gemma4,
    **HYBRID_READERS,
}


def model_kv_from_hf(
    cfg: Mapping[str, Any], *, block_size: int = 16, dtype: str | torch.dtype = "bfloat16", ssm_dtype: str = "auto"
) -> ModelKV:
    """Per-layer specs for a Hugging Face config dict. Unknown model types are an error naming the known ones.
    `ssm_dtype` (vLLM's --mamba-ssm-cache-dtype): the recurrent states' storage, overriding the config's;
    "auto" keeps the config's (else the conv state's dtype)."""
    if ssm_dtype != "auto" and ssm_dtype not in STATE_DTYPES:
        raise ValueError(f"mamba_ssm_cache_dtype must be auto or one of {', '.join(STATE_DTYPES)}, got {ssm_dtype!r}")
    model_type = cfg.get("model_type")
    if model_type not in MODEL_READERS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_READERS))}")
    try:
        layers, shared = MODEL_READERS[model_type](cfg)
    except KeyError as e:
        raise ValueError(f"config of model_type {model_type!r} lacks the field {e.args[0]!r}") from e
    if ssm_dtype != "auto":
        layers = [replace(a, ssm_dtype=ssm_dtype) if isinstance(a, LayerState) else a for a in layers]
    torch_dtype = resolve_dtype(dtype)
    specs = tuple(
        None
        if a is None or i in shared
        else cache_kind(a.kind).spec.from_layer(a, dtype=torch_dtype, block_size=block_size)
        for i, a in enumerate(layers)
    )
    stateless = frozenset(i for i, a in enumerate(layers) if a is None)
    return ModelKV(model_type=model_type, specs=specs, shared=shared, stateless=stateless)
