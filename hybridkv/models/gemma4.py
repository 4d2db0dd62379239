"""Gemma 4 text decoder (`gemma4_text`, and the language model of a multimodal `gemma4` checkpoint).

Per layer: sliding or full attention with its own head size and KV heads, q/k RMSNorm (v normed without a scale),
RoPE per layer type (full layers: `proportional`, rotating only part of the head), attention scale 1, four
norms around attention and MLP, a per-layer-embedding (PLE) residual and a learned `layer_scalar`.
The last `num_kv_shared_layers` layers are KV-sharing consumers: they project only q and read the KV their
target stored (the map comes from `hybridkv.kv.model_kv`). Module names mirror transformers'.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kv.model_kv import MODEL_READERS, LayerAttn
from hybridkv.models.base import AttentionFn, CausalLM, OutputRows, RecurrentStates, embedding
from hybridkv.models.batch_invariant import ACTIVATIONS as EXACT_ACTIVATIONS
from hybridkv.models.batch_invariant import ExactOps
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.fused import norm_kernel
from hybridkv.models.linear import PACKED_DTYPES, Linear, output_logits
from hybridkv.models.llama import ACTIVATIONS
from hybridkv.models.llama import MLP as LlamaMLP
from hybridkv.models.norm import norm_constants, rms_norm, scaled_rms_norm
from hybridkv.models.rope import RopeTables, Rotary, apply_rope

# Gemma4TextConfig's defaults, for configs that leave a field out.
TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}
_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}
_CONSUMER_SKIPS = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _in_dtype(scale: float, dtype: torch.dtype) -> float:
    """`scale` rounded to `dtype`, as transformers multiplies by a scale tensor of the weights' dtype."""
    return torch.tensor(scale, dtype=dtype, device="cpu").item()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.constants: tuple[torch.Tensor, torch.Tensor] | None = None  # set by `prepare`, once weights are final
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `use_fused_ops`

    def prepare(self) -> None:
        if self.weight is not None:
            self.constants = norm_constants(self.dim, self.eps, self.weight.detach())

    def use_fused_ops(self, ops: object) -> None:
        weight = torch.ones(self.dim) if self.weight is None else self.weight
        self.kernel = norm_kernel(ops, weight, self.eps, self.plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x) if self.kernel is None else self.kernel(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.constants is not None:
            return scaled_rms_norm(x, *self.constants)
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], shape: LayerAttn, consumer: bool) -> None:
        super().__init__()
        hidden, heads, hd, eps = cfg["hidden_size"], cfg["num_attention_heads"], shape.head_size, cfg["rms_norm_eps"]
        bias = cfg["attention_bias"]
        self.head_dim, self.eps = hd, eps
        self.q_proj = Linear(hidden, heads * hd, bias=bias)
        self.q_norm = RMSNorm(hd, eps)
        self.o_proj = Linear(heads * hd, hidden, bias=bias)
        self.k_proj = self.v_proj = self.k_norm = self.v_norm = None
        self.k_eq_v = False
        if not consumer:
            self.k_proj = Linear(hidden, shape.num_kv_heads * hd, bias=bias)
            self.k_eq_v = cfg["attention_k_eq_v"] and shape.kind == "full_attention"
            self.v_proj = None if self.k_eq_v else Linear(hidden, shape.num_kv_heads * hd, bias=bias)
            self.k_norm = RMSNorm(hd, eps)
            self.v_norm = RMSNorm(hd, eps, with_scale=False)
        self.qkv: FusedLinear | None = None
        self.head_scale: torch.Tensor | None = None  # set by `fuse`
        self.head_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # `scaled_rms_norm` constants (float32)
        self.num_heads = (heads, 0 if consumer else shape.num_kv_heads)  # (query heads, KV heads)
        self.exact = False  # set by `use_exact`: the stacked heads' norm with exact sums

    def use_exact(self) -> None:
        self.exact = True

    def fuse(self) -> None:
        """One matmul for q/k/v, then one norm and one RoPE over the stacked heads [q | k | v]: per-head norm
        weights q_norm, k_norm and 1 (v is normed unscaled); v heads pass RoPE unrotated."""
        self.qkv = FusedLinear([p for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None])
        self.head_scale = self._head_scale()
        float32 = self.q_proj.weight.dtype == torch.float32
        self.head_norm = norm_constants(self.head_dim, self.eps, self.head_scale) if float32 else None

    def forward(self, layer: int, x: torch.Tensor, rope: RopeTables, attn: AttentionFn) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        hq, hk = self.num_heads
        if self.qkv is not None:
            heads = self.qkv.fused(x).view(n, -1, hd)
        else:
            heads = torch.cat([p(x) for p in (self.q_proj, self.k_proj, self.v_proj) if p is not None], 1)
            heads = heads.view(n, -1, hd)
        if self.k_eq_v:
            heads = torch.cat((heads, heads[:, hq:]), 1)  # values: the keys before k_norm and RoPE
        scale = self.head_scale if self.head_scale is not None else self._head_scale()
        if self.exact:
            normed = ExactOps.rms_norm(heads, scale, self.eps)
        elif self.head_norm is not None:
            normed = scaled_rms_norm(heads, *self.head_norm)
        elif heads.dtype == torch.float32:
            normed = F.rms_norm(heads, (hd,), None, self.eps) * scale
        else:  # norm and scale in float32, then round once, as transformers does
            normed = (F.rms_norm(heads.float(), (hd,), None, self.eps) * scale).type_as(heads)
        out = apply_rope(normed, *rope.for_heads(hq + hk, hk))  # [N, hq + 2 hk, hd]
        kv = out[:, hq:].view(n, 2, hk, hd) if hk else None
        return self.o_proj.forward(attn(layer, out[:, :hq], kv, 1.0).reshape(n, -1))

    def _head_scale(self) -> torch.Tensor:
        """[hq (+ 2 hk), head_dim] float32: each stacked head's norm weight."""
        hq, hk = self.num_heads
        scales = [self.q_norm.weight.float().expand(hq, self.head_dim)]
        if hk:
            scales += [self.k_norm.weight.float().expand(hk, self.head_dim), scales[0].new_ones(hk, self.head_dim)]
        return torch.cat(scales)


class MLP(LlamaMLP):
    """Llama's gated MLP without biases (fused act(gate) * up once `use_fused_ops` ran)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__(hidden, intermediate, act, bias=False)

    def fuse(self) -> None:
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], shape: LayerAttn, consumer: bool) -> None:
        super().__init__()
        hidden, eps, ple = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["hidden_size_per_layer_input"]
        wide = 2 if cfg["use_double_wide_mlp"] and consumer else 1
        self.self_attn = Attention(cfg, shape, consumer)
        self.mlp = MLP(hidden, cfg["intermediate_size"] * wide, cfg["hidden_activation"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.unit_scalar = False  # set by `fuse` once the weights are loaded: skip multiplying by 1
        self.act_name = cfg["hidden_activation"]
        self.act = ACTIVATIONS[self.act_name]
        self.per_layer_input_gate = Linear(hidden, ple, bias=False) if ple else None
        self.per_layer_projection = Linear(ple, hidden, bias=False) if ple else None
        self.post_per_layer_input_norm = RMSNorm(hidden, eps) if ple else None

    def use_exact(self) -> None:
        self.act = EXACT_ACTIVATIONS[self.act_name]

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [N, hidden]
        per_layer_input: torch.Tensor | None,  # [N, hidden_size_per_layer_input]
        rope: RopeTables,
        attn: AttentionFn,
    ) -> torch.Tensor:
        # Submodules' forward is called directly: this runs ~10 times per layer per step, and nn.Module.__call__
        # (hooks machinery) would cost as much as some of the ops.
        h = self.self_attn.forward(layer, self.input_layernorm.forward(x), rope, attn)
        x = x + self.post_attention_layernorm.forward(h)
        x = x + self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(x)))
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm.forward(self.per_layer_projection(gated))
        return x if self.unit_scalar else x * self.layer_scalar


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's text model. `layer_windows[i]`: layer i's sliding window (None: full attention);
    `kv_sharing`: consumer layer -> the layer whose KV it reads."""

    packed_dtypes = PACKED_DTYPES
    batch_invariant = True
    narrows_outputs = True

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        multimodal = "text_config" in cfg
        tied = cfg.get("tie_word_embeddings", True)  # a multimodal checkpoint's own field, not its text_config's
        cfg = {**TEXT_DEFAULTS, **(cfg["text_config"] if multimodal else cfg)}
        _check_supported(cfg)
        shapes, self.kv_sharing = MODEL_READERS["gemma4_text"](cfg)
        # Layers [consumers_from, n) all read others' KV (Gemma 4 shares in its last layers): they may run
        # for the output rows alone.
        n = cfg["num_hidden_layers"]
        self.consumers_from = next(i for i in range(n + 1) if all(j in self.kv_sharing for j in range(i, n)))
        self.narrows_outputs = self.consumers_from < n
        self.layer_windows: list[int | None] = [s.sliding_window for s in shapes]
        # model_kv forces the last layer to full attention, as transformers does.
        self.layer_types = ["full_attention" if s.kind == "full_attention" else "sliding_attention" for s in shapes]
        # A multimodal checkpoint nests the text model; its vision and audio towers are not ours.
        self._prefixes = [("model.language_model.", ""), ("model.", None)] if multimodal else [("model.", "")]

        hidden, n = cfg["hidden_size"], cfg["num_hidden_layers"]
        self.embed_scale = hidden**0.5
        self.embed_tokens = embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, s, i in self.kv_sharing) for i, s in enumerate(shapes))
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.lm_head = None if tied else Linear(hidden, cfg["vocab_size"], bias=False)
        self.softcap: float | None = cfg["final_logit_softcapping"]

        self.ple_dim: int = cfg["hidden_size_per_layer_input"]
        if self.ple_dim:
            self.embed_tokens_per_layer = embedding(cfg["vocab_size_per_layer_input"], n * self.ple_dim)
            self.per_layer_model_projection = Linear(hidden, n * self.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, cfg["rms_norm_eps"])

        self.rotary: dict[str, Rotary] = {}
        for t in sorted(set(self.layer_types)):
            dims = {s.head_size for s, lt in zip(shapes, self.layer_types) if lt == t}
            if len(dims) > 1 or t not in cfg["rope_parameters"]:
                raise ValueError(f"{t} layers need one head_dim and a rope_parameters entry; got {dims}")
            self.rotary[t] = Rotary(cfg["rope_parameters"][t], dims.pop())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,  # attention-only: always None
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """Hidden states [N, hidden], or [M, hidden] for `outputs.rows`: the trailing KV-sharing layers then run
        for those rows alone (in a 4k-token prefill chunk that samples, 1 row of 4096)."""
        x = self.embed_tokens(input_ids) * _in_dtype(self.embed_scale, self.embed_tokens.weight.dtype)
        per_layer = self._per_layer_inputs(input_ids, x) if self.ple_dim else None
        rope = {t: r(positions, x.dtype) for t, r in self.rotary.items()}
        per_layer_inputs = [None] * len(self.layers) if per_layer is None else list(per_layer.unbind(1))
        for i, layer in enumerate(self.layers):
            if i == self.consumers_from and outputs is not None:
                rows, attn = outputs.rows, outputs.attn
                if rows.numel() == 0:  # no chunk samples: the consumers' outputs feed nothing at all
                    return x.new_empty(0, x.shape[1])
                x, positions = x[rows], positions[rows]
                rope = {t: r(positions, x.dtype) for t, r in self.rotary.items()}
                per_layer_inputs = [p if p is None else p[rows] for p in per_layer_inputs]
            x = layer.forward(i, x, per_layer_inputs[i], rope[self.layer_types[i]], attn)
        x = self.norm(x)
        return x[outputs.rows] if outputs is not None and self.consumers_from == len(self.layers) else x

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[N, num_layers, ple_dim]: the token's own per-layer embedding plus a projection of its embedding."""
        shape = (x.shape[0], len(self.layers), self.ple_dim)
        scale = _in_dtype(self.ple_dim**0.5, self.embed_tokens_per_layer.weight.dtype)
        token = (self.embed_tokens_per_layer(input_ids) * scale).view(shape)
        context = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        context = self.per_layer_projection_norm(context.view(shape))
        return (context + token) * 2**-0.5

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            layer.unit_scalar = bool((layer.layer_scalar == 1).all())
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(hidden, self.embed_tokens, self.lm_head, self.softcap)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor, or None to skip it (vision/audio towers, a tied lm_head,
        k/v weights some checkpoints carry for KV-sharing consumers)."""
        for prefix, ours in self._prefixes:
            if name.startswith(prefix):
                if ours is None:
                    return None
                name = ours + name.removeprefix(prefix)
                break
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        consumer_kv = _CONSUMER_SKIPS.match(name)
        return None if consumer_kv and int(consumer_kv[1]) in self.kv_sharing else name


def _check_supported(cfg: Mapping[str, Any]) -> None:
    if cfg.get("enable_moe_block"):
        raise ValueError("Gemma 4 with enable_moe_block (the MoE feed-forward) is not supported")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not causal: not supported")
    if cfg["hidden_activation"] not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {cfg['hidden_activation']!r}")
    for layer, override in (cfg.get("per_layer_config") or {}).items():
        if set(override) - _LAYER_OVERRIDES:
            extra = ", ".join(sorted(set(override) - _LAYER_OVERRIDES))
            raise ValueError(f"per_layer_config of layer {layer} overrides {extra}: only {_LAYER_OVERRIDES} supported")
