"""Mamba2 (SSD) kernels in plain torch, written so that a sequence's result does not depend on how it is split.

Notation, one sequence: T tokens, H heads of P channels, G groups of N state size (head h reads group
h // (H // G)). Per token t and head h, with dt > 0 and A < 0:
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T        [P, N]
    y_t     = state_t C_t + D x_t                              [P]
The chunk scan evaluates this chunk by chunk (SSD): inside a chunk, the quadratic "attention-like" form; across
chunks, the state is handed from one chunk to the next, in order. The chunk grid sits at absolute multiples of
the chunk size from the start of the sequence, so a call starting at position p begins with the partial chunk
[p, next multiple); every chunk is padded to the full chunk size and runs the same ops on the same shapes.
Splitting a sequence at multiples of the chunk size therefore gives the same bits as running it whole.

All recurrences are float32; callers cast on the way in and out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.models.exact import chunk_bounds


def causal_conv(
    x: torch.Tensor,  # [T, D] new inputs, token-major
    state: torch.Tensor,  # [K - 1, D] the K - 1 inputs before them, oldest first (zeros at position 0)
    weight: torch.Tensor,  # [D, K] depthwise taps; tap K - 1 multiplies the current token
    bias: torch.Tensor | None,  # [D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d: y[t] = sum_k weight[:, k] * u[t + k] (+ bias) over u = cat(state, x), the taps
    summed in order k = 0..K-1. Returns (y [T, D], the new state: the last K - 1 rows of u)."""
    k = weight.shape[1]
    t = x.shape[0]
    u = torch.cat([state.to(x.dtype), x])  # [K - 1 + T, D]
    w = weight.t().contiguous()  # [K, D]
    y = u[0:t] * w[0]
    for i in range(1, k):
        y = y + u[i : i + t] * w[i]
    if bias is not None:
        y = y + bias
    return y, u[t:]


def repeat_groups(b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N]: head h reads group h // (H // G)."""
    return b.repeat_interleave(num_heads // b.shape[1], dim=1)


def ssd_step(
    x: torch.Tensor,  # [H, P] one token
    dt: torch.Tensor,  # [H] (after softplus)
    a: torch.Tensor,  # [H] A = -exp(A_log)
    b: torch.Tensor,  # [G, N]
    c: torch.Tensor,  # [G, N]
    d: torch.Tensor,  # [H] skip
    state: torch.Tensor,  # [H, P, N] float32, the state before the token
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token. Returns (y [H, P] float32, the new state [H, P, N] float32)."""
    h = x.shape[0]
    x, dt = x.float(), dt.float()
    b, c = repeat_groups(b[None].float(), h)[0], repeat_groups(c[None].float(), h)[0]  # [H, N]
    decay = torch.exp(dt * a.float())  # [H]
    new = state * decay[:, None, None] + (dt[:, None] * x)[:, :, None] * b[:, None, :]
    y = torch.bmm(new, c[:, :, None])[..., 0] + d.float()[:, None] * x
    return y, new


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [L, H] -> [H, L, L] with entry (l, s) = a[s+1] + ... + a[l] for s <= l and -inf above the diagonal,
    each entry summed directly (not as a difference of two running sums)."""
    length = a.shape[0]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    terms = a.t()[:, :, None].expand(-1, -1, length).masked_fill(~below, 0.0)  # (h, l, s) = a[l] if l > s
    sums = terms.cumsum(dim=1)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, float("-inf"))


def _ssd_chunk(
    xdt: torch.Tensor,  # [L, H, P] x * dt
    da: torch.Tensor,  # [L, H] dt * A (log decay per token)
    b: torch.Tensor,  # [L, H, N]
    c: torch.Tensor,  # [L, H, N]
    state: torch.Tensor,  # [H, P, N] the state before the chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: outputs without the D skip ([L, H, P]) and the state after it. Padded tokens must carry
    xdt = da = b = 0 (they then add nothing and decay nothing)."""
    bh, ch = b.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()  # [H, L, N]
    xh = xdt.transpose(0, 1).contiguous()  # [H, L, P]
    total = da.cumsum(dim=0)  # [L, H] log decay from the chunk start through token l
    # inside the chunk: y[l] = sum_{s <= l} (C_l . B_s) exp(da[s+1..l]) xdt[s]
    weights = torch.bmm(ch, bh.transpose(1, 2)) * torch.exp(_segment_sums(da))  # [H, L, L]
    y_inside = torch.bmm(weights, xh)  # [H, L, P]
    # from the carried state: y[l] += exp(da[0..l]) state C_l
    y_carried = torch.bmm(ch, state.transpose(1, 2)) * torch.exp(total).t()[:, :, None]  # [H, L, P]
    y = (y_inside + y_carried).transpose(0, 1).contiguous()  # [L, H, P]
    # state after the chunk: decayed carried state + each token's contribution decayed to the chunk end
    to_end = torch.exp(total[-1:] - total).t()[:, :, None]  # [H, L, 1]
    new = state * torch.exp(total[-1])[:, None, None] + torch.bmm(xh.transpose(1, 2), bh * to_end)  # [H, P, N]
    return y, new


def ssd_chunk_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] (after softplus and any clamp)
    a: torch.Tensor,  # [H]
    b: torch.Tensor,  # [T, G, N]
    c: torch.Tensor,  # [T, G, N]
    d: torch.Tensor,  # [H]
    state: torch.Tensor,  # [H, P, N] float32, the state before the first token
    start: int,  # absolute position of the first token (anchors the chunk grid)
    chunk: int,  # chunk size C
    round_state: Callable[[torch.Tensor], torch.Tensor] | None = None,  # a quantized storage's rounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over T tokens. Returns (y [T, H, P] float32, the state after the last token [H, P, N] float32).
    `round_state` is applied at every chunk end before the last (`models/state_store`)."""
    t, h = x.shape[:2]
    x, dt = x.float(), dt.float()
    b, c = repeat_groups(b.float(), h), repeat_groups(c.float(), h)
    xdt = x * dt[:, :, None]
    da = dt * a.float()
    ys = []
    for i0, i1 in chunk_bounds(start, t, chunk):
        if i0 > 0 and round_state is not None:
            state = round_state(state)
        pad = chunk - (i1 - i0)
        parts = [xdt[i0:i1], da[i0:i1], b[i0:i1], c[i0:i1]]
        if pad:
            parts = [torch.cat([v, v.new_zeros(pad, *v.shape[1:])]) for v in parts]
        y, state = _ssd_chunk(*parts, state)
        ys.append(y[: i1 - i0])
    y = torch.cat(ys) + d.float()[:, None] * x
    return y, state
