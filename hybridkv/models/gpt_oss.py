"""GPT-OSS (`gpt_oss`: transformers' GptOssForCausalLM).

Per layer: attention (q/k/v/o with biases, sliding window on the sliding layers, one learned sink logit per head
that joins each query's softmax and is dropped from the output), then a mixture of experts: a router with a bias
picks the top-k experts of each token and weighs them by a softmax over the chosen logits; each expert is a
clamped SwiGLU (gate and up interleaved in one projection) with biases. Plain RMSNorms, yarn RoPE whose cos/sin
carry the attention factor. No KV sharing. Module names mirror transformers'.

Only unquantized checkpoints load: the MXFP4 ones (openai/gpt-oss-*) must be dequantized first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.kv.model_kv import MODEL_READERS
from hybridkv.models import norm
from hybridkv.models.base import AttentionFn, CausalLM, RecurrentStates, embedding
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.linear import PACKED_DTYPES, Linear, output_logits
from hybridkv.models.llama import Attention as LlamaAttention
from hybridkv.models.rope import Rotary, apply_rope, rope_parameters

# GptOssConfig's defaults, for configs that leave a field out.
DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 4,
    "rope_theta": 150_000.0,
}
# GptOssConfig's RoPE when a config gives none.
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class RMSNorm(norm.RMSNorm):
    """x / rms(x) * weight in float32, then back to x's dtype; in a float32 model the three-kernel
    `scaled_rms_norm` once `prepare` has run (within float32 rounding of the plain form)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.dim = dim
        self.constants: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        self.constants = norm.norm_constants(self.dim, self.eps, self.weight.detach())

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.constants is not None:
            return norm.scaled_rms_norm(x, *self.constants)
        return super().plain(x)


class Attention(LlamaAttention):
    """Llama's attention (biased q/k/v/o, RoPE on q and k, scale head_dim ** -0.5) plus per-head sinks."""

    def __init__(self, cfg: Mapping[str, Any], head_dim: int) -> None:
        bias = cfg["attention_bias"]
        super().__init__(cfg, head_dim, bias, bias, qk_norm=False)
        self.sinks = nn.Parameter(torch.zeros(cfg["num_attention_heads"]))

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qkv = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.view(n, -1, hd) for t in qkv)
        kv = torch.stack((apply_rope(k, cos, sin), v), 1)
        out = attn(layer, apply_rope(q, cos, sin), kv, self.scale, sinks=self.sinks)
        return self.o_proj(out.reshape(n, -1))


class Experts(nn.Module):
    """The experts' weights as the checkpoint stores them, input-major: gate_up_proj [E, hidden, 2 * I] with gate
    and up interleaved (even columns gate, odd columns up), down_proj [E, I, hidden], and their biases."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        e, hidden, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = nn.Parameter(torch.zeros(e, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(e, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden))
        self.alpha, self.limit = cfg["swiglu_alpha"], cfg["swiglu_limit"]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x [n, hidden]: the gate clamped from above and up on both sides at `limit`, then
        (up + 1) * gate * sigmoid(alpha * gate), projected down."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return h @ self.down_proj[e] + self.down_proj_bias[e]


class MLP(nn.Module):
    """Top-k routing over `Experts`; each token's output is its chosen experts' outputs, weighted."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.top_k = cfg["num_experts_per_tok"]
        self.router = Linear(cfg["hidden_size"], cfg["num_local_experts"], bias=True)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, chosen = self.router(x).topk(self.top_k, dim=-1)  # [N, k] each
        weights = top_logits.softmax(dim=-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # ascending: the experts that received tokens
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts.expert(e, x.index_select(0, token))
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], head_dim: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, head_dim)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn.forward(layer, self.input_layernorm.forward(x), cos, sin, attn)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class GptOssForCausalLM(CausalLM):
    """GPT-OSS. `layer_windows[i]`: layer i's sliding window (None: full attention), as `hybridkv.kv.model_kv`
    plans it; `kv_sharing` is empty."""

    packed_dtypes = PACKED_DTYPES

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**DEFAULTS, **cfg}
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        _check_supported(cfg)
        shapes, self.kv_sharing = MODEL_READERS["gpt_oss"](cfg)
        self.layer_windows: list[int | None] = [s.sliding_window for s in shapes]
        head_dim = shapes[0].head_size

        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.embed_tokens = embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, head_dim) for _ in shapes)
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"])
        self.lm_head = None if cfg["tie_word_embeddings"] else Linear(hidden, vocab, bias=False)
        if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
            cfg["rope_parameters"] = DEFAULT_ROPE
        self.rotary = Rotary(rope_parameters(cfg, default_theta=DEFAULTS["rope_theta"]), head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,  # attention-only: always None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        tables = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(i, x, tables.cos, tables.sin, attn)
        return self.norm.forward(x)

    def fuse_projections(self) -> None:
        for layer in self.layers:
            attn = layer.self_attn
            attn.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(hidden, self.embed_tokens, self.lm_head)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor, or None to skip it (a tied lm_head, RoPE buffers)."""
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: MXFP4-quantized gpt_oss experts are not supported; dequantize the checkpoint")
        if name.endswith("inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
            return None
        return name.removeprefix("model.")


def _check_supported(cfg: Mapping[str, Any]) -> None:
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else "?"
        raise ValueError(
            f"gpt_oss with quantization_config ({method}) is not supported: dequantize the checkpoint "
            "(e.g. transformers' Mxfp4Config(dequantize=True)) and save it unquantized"
        )
    k, e = cfg["num_experts_per_tok"], cfg["num_local_experts"]
    if not 1 <= k <= e:
        raise ValueError(f"gpt_oss num_experts_per_tok={k} must be between 1 and num_local_experts={e}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("gpt_oss num_attention_heads must be a multiple of num_key_value_heads")
