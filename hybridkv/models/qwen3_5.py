"""Qwen3.5 text model: Gated DeltaNet layers and gated full-attention layers (3:1 in released checkpoints).

Module names mirror transformers' (`layers.0.linear_attn.in_proj_qkv`, `layers.3.self_attn.q_proj`, ...): a
text checkpoint loads by dropping `model.`, the multimodal one (`qwen3_5`) by dropping `model.language_model.`
(its vision tower and MTP head are skipped).

Exactness (float32): every projection is `exact.linear` and every non-linearity is built from size-independent
kernels (`exact.silu` ...), so a token's bits do not depend on what shares its call; a GDN layer runs each
request alone: the chunked scan for a call of two or more tokens, the recurrent step for exactly one. In
bfloat16, which makes no bit-for-bit promise, the projections run through packed weights (`linear.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.models import exact, norm
from hybridkv.models.base import AttentionFn, CausalLM, RecurrentStates, embedding
from hybridkv.models.exact import linear
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.fused import ACT_CODES
from hybridkv.models.linear import Linear, project, project_fused
from hybridkv.models.qwen3_5_gdn import GatedDeltaNet
from hybridkv.models.rope import Rotary, apply_rope, rope_parameters

Shape = tuple[int, ...]


RMSNorm = functools.partial(norm.RMSNorm, offset=1.0)  # zero-centred: x / rms(x) * (1 + weight)


class Attention(nn.Module):
    """Full attention with an output gate (q_proj emits each head's query and gate, side by side), zero-centred
    q/k norms and rotary embeddings on the first `rotary_dim` dims of each head."""

    def __init__(self, cfg: Mapping[str, Any], head_dim: int, rotary_dim: int) -> None:
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        bias = cfg.get("attention_bias", False)
        self.head_dim, self.rotary_dim, self.scale = head_dim, rotary_dim, head_dim**-0.5
        self.q_proj = Linear(hidden, heads * head_dim * 2, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(head_dim, cfg["rms_norm_eps"])

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim]: rotate the first rotary_dim dims, pass the rest."""
        r = self.rotary_dim
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), -1)

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        query, gate = project(self.q_proj, x).view(n, -1, 2 * hd).split(hd, -1)  # each [N, heads, hd]
        q = self.rope(self.q_norm(query), cos, sin)
        k = self.rope(self.k_norm(project(self.k_proj, x).view(n, -1, hd)), cos, sin)
        v = project(self.v_proj, x).view(n, -1, hd)
        out = attn(layer, q, torch.stack((k, v), 1), self.scale).reshape(n, -1)
        return project(self.o_proj, out * exact.sigmoid(gate.reshape(n, -1)))


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused into one matmul (`fuse`). With the fused-ops kernel (handed
    over only where the projections are packed: bfloat16) silu(gate) * up is one call."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gate_up: FusedLinear | None = None
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `use_fused_ops`

    def fuse(self) -> None:
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def use_fused_ops(self, ops: object) -> None:
        if self.gate_up is not None:
            self.act_and_mul = lambda gate_up: ops.act_and_mul(gate_up, ACT_CODES["silu"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        elif self.act_and_mul is not None:
            return project(self.down_proj, self.act_and_mul(project_fused(self.gate_up, x)))
        else:
            gate, up = project_fused(self.gate_up, x).split(self.gate_up.sizes, -1)
        return project(self.down_proj, exact.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer_type: str, head_dim: int, rotary_dim: int) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg, head_dim, rotary_dim)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, 1, rotary_dim]
        attn: AttentionFn,
        states: RecurrentStates,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            x = x + self.linear_attn(layer, h, positions, states)
        else:
            x = x + self.self_attn(layer, h, *rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's fields: `text_config` of a multimodal `qwen3_5` config (tie_word_embeddings from the
    top level, where transformers reads it), else the config itself."""
    if "text_config" not in cfg:
        return {"rms_norm_eps": 1e-6, **cfg}
    text = {"rms_norm_eps": 1e-6, **cfg["text_config"]}
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """`layer_types`, or every `full_attention_interval`-th layer full (older configs)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    unknown = set(types) - {"linear_attention", "full_attention"}
    if len(types) != n or unknown:
        raise ValueError(f"layer_types must name {n} layers linear_attention/full_attention, got {types}")
    return list(types)


class Qwen3_5ForCausalLM(CausalLM):
    """qwen3_5_text, and the text model of qwen3_5. `layer_windows` is None for every layer (the attention layers
    are full; GDN layers call no AttentionFn); `state_shapes()` gives each GDN layer's (conv, recurrent) shapes."""

    steps_states_in_place: ClassVar[bool] = True
    packed_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)  # float32 keeps exact sums

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.multimodal = "text_config" in cfg
        cfg = text_config(cfg)
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rope = rope_parameters(cfg)
        if rope["rope_type"] != "default":
            raise ValueError(f"unsupported rope_type {rope['rope_type']!r} for qwen3_5; supported: default")
        rope.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        # Text tokens carry one position on all three M-RoPE axes, so M-RoPE is plain RoPE over rotary_dim.
        rotary_dim = int(head_dim * rope["partial_rotary_factor"])
        self.layer_types = layer_types(cfg)
        self.layer_windows: list[int | None] = [None] * len(self.layer_types)
        self.kv_sharing: dict[int, int] = {}

        self.embed_tokens = embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, head_dim, rotary_dim) for t in self.layer_types)
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = None if tied else Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.rotary = Rotary(rope, rotary_dim)

    def state_shapes(self) -> dict[int, tuple[Shape, Shape]]:
        """GDN layer -> (conv [K - 1, conv_dim], recurrent [Hv, dk, dv]), as `RecurrentStates` must size them."""
        return {i: layer.linear_attn.state_shapes() for i, layer in enumerate(self.layers) if layer.is_linear}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,
    ) -> torch.Tensor:
        if states is None:
            raise ValueError("Qwen3.5 has Gated DeltaNet layers: forward needs `states`")
        x = self.embed_tokens(input_ids)
        tables = self.rotary(positions, x.dtype)
        rope = (tables.cos, tables.sin)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, positions, rope, attn, states)
        return self.norm(x)

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.mlp.fuse()
            if layer.is_linear:
                layer.linear_attn.fuse()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(self.lm_head, hidden) if self.lm_head is not None else linear(hidden, self.embed_tokens.weight)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor, or None to skip it (vision tower, MTP head, tied head)."""
        if name.startswith(("mtp.", "model.visual.", "visual.")) or name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        return name.removeprefix("model.language_model.").removeprefix("model.")
