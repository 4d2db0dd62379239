"""Tiny random-weight transformers models saved to disk, and the runs we compare against them.

Weights are re-drawn at a scale where logits spread out (norm weights, layer scalars around 1), so a wrong
norm, scale or RoPE shows in the logits instead of vanishing into near-uniform outputs.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from hybridkv.models.base import CausalLM
from hybridkv.models.reference_attention import ReferenceAttention
from tests.tiny_models import GEMMA4_TINY as GEMMA4_TINY

TOL = 1e-4


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        else:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)


def save_random(model: torch.nn.Module, path: Path, seed: int = 0, **save_kw) -> torch.nn.Module:
    """Randomize a freshly built transformers model, save it to `path`, return it ready for inference with eager
    attention: transformers' plain-math path (its SDPA path alone differs from it by up to ~7e-5 here)."""
    randomize(model, seed)
    model.save_pretrained(path, **save_kw)
    model.set_attn_implementation("eager")
    return model.eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids[None]).logits[0]


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then decode one token at a time through transformers' own cache: tokens and [steps, vocab]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids, tokens, logits = prompt[None], [], []
    for _ in range(steps):
        step = hf(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


@torch.no_grad()
def our_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    attn = ReferenceAttention.for_model(model)
    return model.compute_logits(model(ids, torch.arange(len(ids)), attn))


@torch.no_grad()
def our_greedy(model: CausalLM, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Same as `hf_greedy`, through our model and the reference attention's per-layer KV store."""
    attn = ReferenceAttention.for_model(model)
    ids, positions, tokens, logits = prompt, torch.arange(len(prompt)), [], []
    for _ in range(steps):
        step = model.compute_logits(model(ids, positions, attn)[-1:])[0]
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids, positions = torch.tensor([tokens[-1]]), positions[-1:] + 1
    return tokens, torch.stack(logits)


def prompt(n: int, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_parity(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    diff = (ours - theirs).abs().max().item()
    assert diff <= TOL, f"max abs logit difference {diff:.3g} > {TOL}"
    return diff
