"""Gemma 3 text decoder (`gemma3_text`: transformers' Gemma3ForCausalLM).

Per layer: sliding or full attention (five sliding to one full by default), q/k RMSNorm per head, attention scale
`query_pre_attn_scalar ** -0.5`, RoPE per layer type (sliding layers: the local base; full layers: `rope_theta`
with its scaling), four norms around attention and MLP. Every RMSNorm scales by (1 + weight); embeddings are
scaled by sqrt(hidden) rounded to the weights' dtype. No KV sharing. Module names mirror transformers'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.kv.model_kv import GEMMA3_SHAPE_DEFAULTS, MODEL_READERS
from hybridkv.models import norm, rope
from hybridkv.models.base import AttentionFn, CausalLM, RecurrentStates, embedding
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.gemma4 import _in_dtype
from hybridkv.models.linear import PACKED_DTYPES, Linear, output_logits
from hybridkv.models.llama import ACTIVATIONS, MLP
from hybridkv.models.llama import Attention as LlamaAttention

# Gemma3TextConfig's defaults, for configs that leave a field out.
TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    **GEMMA3_SHAPE_DEFAULTS,  # the KV planner reads the same
}
# Per layer type: the legacy field holding its RoPE base, and transformers' default base.
_ROPE_BASES = {"full_attention": ("rope_theta", 1_000_000.0), "sliding_attention": ("rope_local_base_freq", 10_000.0)}


class RMSNorm(norm.RMSNorm):
    """Gemma's zero-centred RMSNorm, x / rms(x) * (1 + weight) in float32; in a float32 model the three-kernel
    `scaled_rms_norm` once `prepare` has run (within float32 rounding of the plain form)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, offset=1.0)
        self.dim = dim
        self.constants: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        self.constants = norm.norm_constants(self.dim, self.eps, 1.0 + self.weight.detach())

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.constants is not None:
            return norm.scaled_rms_norm(x, *self.constants)
        return super().plain(x)


class Attention(LlamaAttention):
    """Llama's attention (q/k/v, per-head q/k norms, RoPE on q and k) with Gemma's norms and scale."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        bias = cfg["attention_bias"]
        super().__init__(cfg, cfg["head_dim"], bias, bias, qk_norm=False)
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.scale = cfg["query_pre_attn_scalar"] ** -0.5


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Attention(cfg)
        self.mlp = MLP(hidden, cfg["intermediate_size"], cfg["hidden_activation"], bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, layer: int, x: torch.Tensor, tables: rope.RopeTables, attn: AttentionFn) -> torch.Tensor:
        h = self.self_attn.forward(layer, self.input_layernorm.forward(x), tables.cos, tables.sin, attn)
        x = x + self.post_attention_layernorm.forward(h)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(x)))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model. `layer_windows[i]`: layer i's sliding window (None: full attention), as
    `hybridkv.kv.model_kv` plans it; `kv_sharing` is empty."""

    packed_dtypes = PACKED_DTYPES
    batch_invariant = True

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**TEXT_DEFAULTS, **cfg}
        _check_supported(cfg)
        shapes, self.kv_sharing = MODEL_READERS["gemma3_text"](cfg)
        self.layer_windows: list[int | None] = [s.sliding_window for s in shapes]
        self.layer_types = ["full_attention" if s.kind == "full_attention" else "sliding_attention" for s in shapes]

        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.embed_scale = hidden**0.5
        self.embed_tokens = embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in shapes)
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.lm_head = None if cfg["tie_word_embeddings"] else Linear(hidden, vocab, bias=False)
        self.softcap: float | None = cfg["final_logit_softcapping"]
        params = rope_parameters_by_type(cfg)
        self.rotary = {t: rope.Rotary(params[t], cfg["head_dim"]) for t in sorted(set(self.layer_types))}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,  # attention-only: always None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * _in_dtype(self.embed_scale, self.embed_tokens.weight.dtype)
        tables = {t: r(positions, x.dtype) for t, r in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            x = layer.forward(i, x, tables[self.layer_types[i]], attn)
        return self.norm.forward(x)

    def fuse_projections(self) -> None:
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up = FusedLinear([mlp.gate_proj, mlp.up_proj])
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(hidden, self.embed_tokens, self.lm_head, self.softcap)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor, or None to skip it (a tied lm_head, RoPE buffers)."""
        if name.endswith("inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
            return None
        return name.removeprefix("model.")


def rope_parameters_by_type(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Layer type -> flat RoPE parameters, read as Gemma3TextConfig reads them: `rope_parameters` keyed by layer
    type (transformers >= 5), else the older fields: `rope_theta` and `rope_scaling` for full layers,
    `rope_local_base_freq` for sliding ones. A missing base takes transformers' default."""
    given = cfg.get("rope_parameters") or {}
    if set(given) - set(_ROPE_BASES):
        raise ValueError(f"gemma3_text rope_parameters must be keyed by layer type ({', '.join(_ROPE_BASES)})")
    out = {}
    for layer_type, (base_field, default_base) in _ROPE_BASES.items():
        params = dict(given.get(layer_type) or {})
        if layer_type == "full_attention" and cfg.get("rope_scaling"):
            params.update(cfg["rope_scaling"])
        flat = {
            "rope_parameters": params,
            "rope_theta": cfg.get(base_field, default_base),
            "max_position_embeddings": cfg.get("max_position_embeddings"),
        }
        out[layer_type] = rope.rope_parameters(flat)
    return out


def _check_supported(cfg: Mapping[str, Any]) -> None:
    if cfg["use_bidirectional_attention"]:
        raise ValueError("Gemma 3 with use_bidirectional_attention is not causal: not supported")
    if cfg["attn_logit_softcapping"] is not None:
        raise ValueError(
            "Gemma 3 with attn_logit_softcapping is not supported: our attention function applies no softcap"
        )
    if cfg["hidden_activation"] not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r}")
