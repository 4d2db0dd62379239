"""Dense Llama-style decoders: llama, mistral, qwen2 (q/k/v biases) and qwen3 (per-head q/k RMSNorm).

Module names mirror transformers' (`layers.3.self_attn.q_proj`, ...) so a checkpoint loads by dropping `model.`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kv.model_kv import MODEL_READERS
from hybridkv.models.base import AttentionFn, CausalLM, RecurrentStates, embedding
from hybridkv.models.batch_invariant import ACTIVATIONS as EXACT_ACTIVATIONS
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.fused import ACT_CODES, norm_kernel, rope_kernel
from hybridkv.models.linear import PACKED_DTYPES, Linear, output_logits
from hybridkv.models.norm import norm_constants, scaled_rms_norm
from hybridkv.models.rope import Rotary, apply_rope, rope_parameters

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.constants: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 only: set by `prepare`
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `use_fused_ops`

    def prepare(self) -> None:
        self.constants = norm_constants(self.dim, self.eps, self.weight.detach())

    def use_fused_ops(self, ops: object) -> None:
        self.kernel = norm_kernel(ops, self.weight, self.eps, self.plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x) if self.kernel is None else self.kernel(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.constants is not None:
            return scaled_rms_norm(x, *self.constants)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg["rms_norm_eps"]) if qk_norm else None
        self.qkv: FusedLinear | None = None
        self.rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope

    def use_fused_ops(self, ops: object) -> None:
        self.rope = rope_kernel(ops, apply_rope)

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qkv = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.view(n, -1, hd) for t in qkv)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)  # .forward: no module hooks per decode step
        out = attn(layer, self.rope(q, cos, sin), torch.stack((self.rope(k, cos, sin), v), 1), self.scale)
        return self.o_proj.forward(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: FusedLinear | None = None
        self.act_name = act
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by `use_fused_ops`

    def use_fused_ops(self, ops: object) -> None:
        if self.gate_up is not None and self.act_name in ACT_CODES:
            code = ACT_CODES[self.act_name]
            self.act_and_mul = lambda gate_up: ops.act_and_mul(gate_up, code)

    def use_exact(self) -> None:
        """Exact arithmetic (`batch_invariant`): the activation too where act * up is not fused."""
        self.act = EXACT_ACTIVATIONS[self.act_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_and_mul is not None:
            return self.down_proj.forward(self.act_and_mul(self.gate_up.fused(x)))
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, head_dim, qkv_bias, o_bias, qk_norm)
        mlp_bias = cfg.get("mlp_bias", False)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"), mlp_bias)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    """llama, mistral, qwen2, qwen3. `layer_windows[i]` is layer i's sliding window (None: full attention),
    as `hybridkv.kv.model_kv` plans it; dense models share no KV."""

    packed_dtypes = PACKED_DTYPES
    batch_invariant = True

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        model_type = cfg.get("model_type")
        cfg = {"rms_norm_eps": 1e-6, **cfg}
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        layers, _ = MODEL_READERS[model_type](cfg)
        self.layer_windows: list[int | None] = [a.sliding_window for a in layers]
        self.kv_sharing: dict[int, int] = {}

        qwen2 = model_type == "qwen2"
        bias = cfg.get("attention_bias", False)
        qkv_bias, o_bias = (True, False) if qwen2 else (bias, bias)
        qk_norm = model_type == "qwen3"
        self.embed_tokens = embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, head_dim, qkv_bias, o_bias, qk_norm) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        tied = cfg.get("tie_word_embeddings", False)
        self.lm_head = None if tied else Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.rotary = Rotary(rope_parameters(cfg), head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,  # attention-only: always None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        cos, sin = rope.cos, rope.sin
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attn)
        return self.norm(x)

    def fuse_projections(self) -> None:
        for layer in self.layers:
            layer.self_attn.qkv = FusedLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
            layer.mlp.gate_up = FusedLinear([layer.mlp.gate_proj, layer.mlp.up_proj])
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(hidden, self.embed_tokens, self.lm_head)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor, or None to skip it."""
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
            return None
        return name.removeprefix("model.")
