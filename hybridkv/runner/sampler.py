"""Sampler: greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] = (),
) -> list[int]:
    """logits: [M, vocab]. `banned[i]` are token ids row i may not pick (EOS before min_tokens)."""
    logits = logits.float()
    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        out[i] = int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item())
    return out
