"""A tiny random Nemotron-H checkpoint (4 Mamba2 + 2 attention + 2 MLP layers) built with transformers.

Weights are redrawn so that logits spread out and the Mamba2 layers keep a memory of a few dozen tokens: the
decay per token exp(dt * A) lies around 0.5-0.99, so state carried across a chunk boundary matters, and dt
straddles `time_step_min`, so a clamp at it (transformers 5.24's bug, in its chunk path only) would show.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

NEMOTRON_H_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    hybrid_override_pattern="M*M-M*M-",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=32,
    time_step_min=0.01,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def nemotron_h_config(**kw):
    """The tiny config; keyword arguments override its fields."""
    from transformers import NemotronHConfig

    return NemotronHConfig(**(NEMOTRON_H_TINY | kw))


@torch.no_grad()
def randomize_nemotron_h(model: torch.nn.Module, seed: int = 0) -> None:
    """Matrices ~ N(0, 1/fan_in), norm weights in [0.5, 1.5); per Mamba head: A = -exp(A_log) in [-4, -0.5],
    dt_bias such that softplus(dt_bias) lies in [0.005, 0.1] (log-uniform), D in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(math.log(0.5), math.log(4.0), generator=g))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(0.005), math.log(0.1), generator=g))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
        else:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def build_nemotron_h(folder: Path, seed: int = 0, **config) -> torch.nn.Module:
    """Save a random tiny NemotronHForCausalLM (config fields overridden by `config`) to `folder`; return it in
    eval mode with eager attention (transformers' plain-math path)."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(nemotron_h_config(**config)).to(torch.float32)
    randomize_nemotron_h(model, seed)
    model.save_pretrained(folder)
    model.set_attn_implementation("eager")
    return model.eval()
