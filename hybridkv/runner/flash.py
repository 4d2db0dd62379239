"""Attention calls that also need the softmax's log-sum-exp: a prefill chunk attended as prefix + causal self
(two mask-free CPU flash calls merged by their log-sum-exps), and attention sinks (GPT-OSS), which rescale an
output by sigmoid(lse - sink). Plain torch; the CPU flash kernel where it applies, plain math elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefix_and_causal(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """q [1, Hq, n, D] at positions [start, start + n) over keys [1, Hk, >= start + n, D]: the prefix [0, start)
    is visible to every query and the chunk's own keys causally, so each part is one mask-free flash call (CPU,
    which also returns the log-sum-exp) and the parts merge by their softmax weights."""
    n, g = q.shape[2], q.shape[1] // keys.shape[1]
    k, v = keys[:, :, : start + n], values[:, :, : start + n]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own, own_lse = flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
    if start == 0:
        return own if sinks is None else with_sinks(own, own_lse, sinks.view(1, -1, 1))
    pre, pre_lse = flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
    top = torch.maximum(own_lse, pre_lse)
    w_own, w_pre = (own_lse - top).exp_().unsqueeze(-1), (pre_lse - top).exp_().unsqueeze(-1)
    out = (own.float() * w_own + pre.float() * w_pre) / (w_own + w_pre)
    if sinks is not None:
        out = with_sinks(out, top + (w_own + w_pre).squeeze(-1).log(), sinks.view(1, -1, 1))
    return out.to(q.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, sinks):
    """SDPA of q [B, Hq, L, D] over keys [B, Hk, Lk, D] under an additive mask; with sinks, through the
    log-sum-exp (K/V expanded to the query heads)."""
    gqa = q.shape[1] != keys.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        g = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    out, lse = attend_with_lse(q, keys, values, mask, scale)
    return with_sinks(out, lse, sinks.view(1, -1, 1))


def attend_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, L, D], log-sum-exp [B, H, L] float32) of attention with equal head counts: torch's CPU flash
    kernel where it applies, else plain math."""
    if q.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(q, keys, values, 0.0, False, attn_mask=mask.to(q.dtype), scale=scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale + mask
    lse = torch.logsumexp(scores, -1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp(), values.float()).to(q.dtype), lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output `out` [..., H, L, D] whose softmax had log-normaliser `lse` [..., H, L], rescaled as if
    each head's denominator also held exp(sink): by Z / (Z + e^sink) = sigmoid(lse - sink). `sinks` is shaped to
    broadcast against lse ([1, H, 1] for [B, H, L]; [1, Hk, G] for a decode's [B, Hk, G])."""
    factor = torch.sigmoid(lse - sinks.float()).unsqueeze(-1)
    return (out.float() * factor).to(out.dtype)
