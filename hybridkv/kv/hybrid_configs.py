"""Config readers for recurrent hybrids: Gated DeltaNet (qwen3_5, qwen3_next) and Mamba2 (nemotron_h,
granitemoehybrid, bamba) next to full attention. Field names follow transformers 5.24's config classes; a missing
shape field is a KeyError, which `model_kv_from_hf` turns into a ValueError naming it.

State dtypes: the conv state takes the KV dtype unless the config names `mamba_cache_dtype`; the recurrent state
takes the dtype the config asks for (Qwen3.5's `mamba_ssm_dtype`, Nemotron-H's `mamba_ssm_cache_dtype`), else the
conv state's. "auto" means "not named".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.kv.layers import LayerAttn, head_dim, kv_heads
from hybridkv.kv.state import LayerState

Layers = tuple[list[LayerAttn | LayerState | None], dict[int, int]]
GDN_CHUNK = 64  # the Gated DeltaNet chunked scan's chunk (transformers' torch_chunk_gated_delta_rule, FLA)


def _named_dtype(cfg: Mapping[str, Any], key: str) -> str | None:
    value = cfg.get(key)
    return None if value in (None, "auto") else str(value)


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` the config has (configs spell some Mamba2 fields two ways); else `default`, or a
    KeyError naming the first key when there is no default."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is None:
        raise KeyError(keys[0])
    return default


def _attention(cfg: Mapping[str, Any], dim: int | None = None) -> LayerAttn:
    return LayerAttn("full_attention", kv_heads(cfg), dim or head_dim(cfg))


def _check_count(cfg: Mapping[str, Any], types: list[str], what: str) -> None:
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(types):
        raise ValueError(f"{what} names {len(types)} layers but num_hidden_layers is {n}: make them agree")


# ---- Gated DeltaNet: qwen3_5 (multimodal: its text_config), qwen3_5_text, qwen3_next


def _gdn_types(cfg: Mapping[str, Any]) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is attention
        interval = cfg.get("full_attention_interval", 4)
        n = cfg["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    _check_count(cfg, list(types), "layer_types")
    return list(types)


def _gated_deltanet(cfg: Mapping[str, Any]) -> Layers:
    if "text_config" in cfg:
        cfg = cfg["text_config"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    state = LayerState(
        mixer="gated_deltanet",
        conv_kernel=cfg["linear_conv_kernel_dim"],
        conv_dim=2 * hk * dk + hv * dv,  # the conv runs over [q, k, v]
        ssm_shape=(hv, dk, dv),
        chunk_size=GDN_CHUNK,
        conv_dtype=_named_dtype(cfg, "mamba_cache_dtype"),
        ssm_dtype=_named_dtype(cfg, "mamba_ssm_dtype"),
    )
    layers: list[LayerAttn | LayerState | None] = []
    for i, t in enumerate(_gdn_types(cfg)):
        if t == "linear_attention":
            layers.append(state)
        elif t == "full_attention":
            layers.append(_attention(cfg))
        else:
            raise ValueError(f"layer {i} has unsupported type {t!r}; supported: linear_attention, full_attention")
    return layers, {}


# ---- Mamba2: nemotron_h, granitemoehybrid, bamba


def _mamba2(
    cfg: Mapping[str, Any], heads: int, head: int, groups: int, state: int, kernel: int, chunk: int, ssm_key: str
) -> LayerState:
    return LayerState(
        mixer="mamba2",
        conv_kernel=kernel,
        conv_dim=heads * head + 2 * groups * state,  # the conv runs over [x, B, C]
        ssm_shape=(heads, head, state),
        chunk_size=chunk,
        conv_dtype=_named_dtype(cfg, "mamba_cache_dtype"),
        ssm_dtype=_named_dtype(cfg, ssm_key),
    )


# Nemotron-H's pattern letters, and the layer-type names of its layers_block_type (old and new spellings).
_NEMOTRON = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_TYPE_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def _nemotron_h(cfg: Mapping[str, Any]) -> Layers:
    if cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        bad = sorted(set(pattern) - set(_NEMOTRON))
        if bad:
            known = "M (Mamba2), * (attention), - (MLP), E (MoE)"
            raise ValueError(f"hybrid_override_pattern has unknown letters {bad}; known: {known}")
        types = [_NEMOTRON[c] for c in pattern]
        _check_count(cfg, types, "hybrid_override_pattern")
    else:
        types = [_TYPE_NAMES.get(t, t) for t in _first(cfg, "layers_block_type", "layer_types")]
        _check_count(cfg, types, "layers_block_type")
    mamba = _mamba2(
        cfg,
        heads=cfg["mamba_num_heads"],
        head=cfg["mamba_head_dim"],
        groups=_first(cfg, "n_groups", "mamba_n_groups"),
        state=cfg["ssm_state_size"],
        kernel=_first(cfg, "conv_kernel", "mamba_d_conv"),
        chunk=_first(cfg, "chunk_size", "mamba_chunk_size", default=128),  # transformers' default
        ssm_key="mamba_ssm_cache_dtype",
    )
    dim = cfg.get("head_dim") or cfg.get("attention_head_dim")
    layers: list[LayerAttn | LayerState | None] = []
    for i, t in enumerate(types):
        if t not in ("mamba", "attention", "mlp", "moe"):
            raise ValueError(f"layer {i} has unsupported type {t!r}; supported: mamba, attention, mlp, moe")
        layers.append(mamba if t == "mamba" else _attention(cfg, dim) if t == "attention" else None)
    return layers, {}


def _granite_mamba(cfg: Mapping[str, Any]) -> LayerState:
    heads = cfg["mamba_n_heads"]
    head = cfg["mamba_d_head"]
    if head == "auto":  # transformers: mamba_expand * hidden_size // mamba_n_heads
        head = cfg["mamba_expand"] * cfg["hidden_size"] // heads
    return _mamba2(
        cfg,
        heads=heads,
        head=head,
        groups=cfg["mamba_n_groups"],
        state=cfg["mamba_d_state"],
        kernel=cfg["mamba_d_conv"],
        chunk=cfg.get("mamba_chunk_size") or 256,  # transformers' default
        ssm_key="mamba_ssm_cache_dtype",
    )


def _granitemoehybrid(cfg: Mapping[str, Any]) -> Layers:
    types = [_TYPE_NAMES.get(t, t) for t in _first(cfg, "layer_types", "layers_block_type")]
    _check_count(cfg, types, "layer_types")
    mamba = _granite_mamba(cfg)
    layers: list[LayerAttn | LayerState | None] = []
    for i, t in enumerate(types):
        if t not in ("mamba", "attention"):
            raise ValueError(f"layer {i} has unsupported type {t!r}; supported: mamba, attention")
        layers.append(mamba if t == "mamba" else _attention(cfg))
    return layers, {}


def _bamba(cfg: Mapping[str, Any]) -> Layers:
    n = cfg["num_hidden_layers"]
    attn = set(cfg["attn_layer_indices"])
    if not attn <= set(range(n)):
        raise ValueError(f"attn_layer_indices {sorted(attn - set(range(n)))} are not layers of {n}")
    mamba = _granite_mamba(cfg)
    return [_attention(cfg) if i in attn else mamba for i in range(n)], {}


HYBRID_READERS = {
    "qwen3_5": _gated_deltanet,
    "qwen3_5_text": _gated_deltanet,
    "qwen3_next": _gated_deltanet,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granitemoehybrid,
    "bamba": _bamba,
}
