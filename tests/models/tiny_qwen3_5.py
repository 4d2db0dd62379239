"""A tiny random Qwen3.5 text checkpoint built with transformers, for parity and exactness tests.

8 layers, 3 Gated DeltaNet : 1 full attention. The GDN heads are all different sizes (Hk 2, Hv 4, dk 16,
dv 32), so a swapped head mapping or a transposed state changes shapes or results; attention uses
partial rotary (head_dim 32, factor 0.25: 8 rotated dims) and GQA (4 query, 2 KV heads).
"""

from __future__ import annotations

from pathlib import Path

import torch

L, F = "linear_attention", "full_attention"

QWEN3_5_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    layer_types=[L, L, L, F, L, L, L, F],
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def qwen3_5_config(**kw):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**(QWEN3_5_TINY | kw))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights at a scale where logits spread out: matrices ~ N(0, 1/fan_in), norm weights around 1 (zero-centred
    norms: 1 + w in [0.5, 1.5]), and per-head GDN decays from slow to fast (g = -A * softplus(a + dt_bias) with A
    in [0.02, 2]), so the state carries information across chunk boundaries. Queries are drawn close to keys, as
    trained models have them: with independent q and k the GDN outputs are tiny, their gated RMSNorm amplifies
    rounding ~1000x over the 6 GDN layers, and transformers' own chunked and recurrent paths then differ by
    1.2e-4 in the logits (3e-5 with aligned q, k), too close to the 1e-4 parity tolerance."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            p.copy_(torch.linspace(0.02, 2.0, p.numel()).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.rand(p.shape, generator=g) - 1.5)
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        elif name.endswith("linear_attn.norm.weight"):  # plain weight (not 1 + w)
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        else:  # zero-centred RMSNorm weights
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    for module in model.modules():
        if hasattr(module, "in_proj_qkv"):  # a GDN layer: align queries with keys (q = 0.7 k + 0.3 noise)
            kd = module.key_dim
            for w in (module.in_proj_qkv.weight, module.conv1d.weight):
                w[:kd] = 0.7 * w[kd : 2 * kd] + 0.3 * w[:kd]


def build(folder: Path, seed: int = 0, **config) -> torch.nn.Module:
    """Save a random `Qwen3_5ForCausalLM` (text only) to `folder`; return it in float32 eval mode with eager
    attention (transformers' plain-math path)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(qwen3_5_config(**config)).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(folder)
    model.set_attn_implementation("eager")
    return model.eval()


def build_multimodal(folder: Path, seed: int = 0) -> torch.nn.Module:
    """The same text model inside a `Qwen3_5ForConditionalGeneration` (model_type qwen3_5) with a one-block
    vision tower: its checkpoint names the text weights `model.language_model.*` and adds `model.visual.*`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = {k: v for k, v in QWEN3_5_TINY.items() if k != "tie_word_embeddings"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(folder)
    model.set_attn_implementation("eager")
    return model.eval()
