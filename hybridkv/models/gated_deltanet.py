"""Gated DeltaNet (Qwen3.5, Qwen3-Next) in plain torch: the causal conv, the chunked scan and the one-token step.

The recurrence, per value head h (state S [dk, dv], float32), for token t with l2-normalised q_t, k_t and
q_t scaled by 1 / sqrt(dk):
    S = exp(g_t) * S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
Value head h reads query/key head h // (Hv / Hk) (consecutive value heads share a key head).

Exactness: every function here gives a token the same bits whatever else shares its call, as long as multi-token
calls are split only at multiples of the chunk size C from the sequence start:
  - the chunk grid is anchored at absolute positions (a call starting at p runs [p, next multiple of C) as a
    partial first chunk), every chunk is padded to exactly C rows and run by the same `_chunk` with the same
    shapes, one after another, passing the state in order;
  - the conv is a fixed-order sum of element-wise products (exact per element, so layout- and length-free);
  - activations come from `exact` (torch's own silu/sigmoid/softplus give an element's bits by tensor length).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.models import exact

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the form FLA and transformers use), |x|^2 summed exactly."""
    return x * torch.rsqrt(exact.square_sum(x).to(x.dtype) + eps)


def causal_conv1d(
    x: torch.Tensor,  # [T, D] new conv inputs, token-major
    window: torch.Tensor,  # [K - 1, D] the K - 1 inputs before x, oldest first (zeros at the sequence start)
    weight: torch.Tensor,  # [K, D] tap k multiplies the input K - 1 - k tokens back
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv: y[t] = sum_k weight[k] * cat(window, x)[t + k], summed in tap order, in float32.
    Returns y [T, D] (x's dtype) and the new window [K - 1, D]: the last K - 1 rows of cat(window, x)."""
    taps, t = weight.shape[0], x.shape[0]
    xp = torch.cat((window.to(torch.float32), x.to(torch.float32)))  # [K - 1 + T, D]
    w = weight.to(torch.float32)
    y = xp[0:t] * w[0]
    for k in range(1, taps):
        y = y + xp[k : k + t] * w[k]
    return y.to(x.dtype), xp[t:].to(window.dtype)


def chunk_bounds(start: int, n: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """`exact.chunk_bounds` with GDN's chunk."""
    return exact.chunk_bounds(start, n, chunk)


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., Hk, d] -> [..., Hv, d]: value head h reads key head h // (Hv / Hk)."""
    return x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _padded(x: torch.Tensor, a: int, b: int, rows: int) -> torch.Tensor:
    """Rows [a, b) of x as a float32 block of exactly `rows` rows, zeros after them."""
    block = x.new_zeros((rows, *x.shape[1:]), dtype=torch.float32)
    block[: b - a] = x[a:b]
    return block


def _chunk(
    q: torch.Tensor,  # [Hv, C, dk] normalised and scaled; zero rows past the chunk's tokens
    k: torch.Tensor,  # [Hv, C, dk] normalised; zero padding rows
    v: torch.Tensor,  # [Hv, C, dv]
    g: torch.Tensor,  # [Hv, C] log decays (<= 0), zero padding
    beta: torch.Tensor,  # [Hv, C], zero padding (padding rows then leave the state unchanged)
    state: torch.Tensor,  # [Hv, dk, dv] float32, the state before the chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the delta rule in matrix form (all float32). With gamma the in-chunk cumulative log decay and
    the state S0 before the chunk, the per-token state updates d_i (S_i = e^(gamma_i) S0 + sum_j<=i
    e^(gamma_i - gamma_j) k_j d_j^T) solve the unit lower-triangular system
        d_i + beta_i sum_{j<i} e^(gamma_i - gamma_j) (k_i . k_j) d_j = beta_i (v_i - e^(gamma_i) S0^T k_i).
    Returns the outputs o_i = S_i^T q_i [Hv, C, dv] and the state after the chunk [Hv, dk, dv]."""
    size = g.shape[-1]
    gamma = g.cumsum(-1)  # [Hv, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()  # j <= i
    decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, C, C]

    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only the strictly lower part is read
    rhs = torch.cat((v * beta[..., None], k_beta * gamma.exp()[..., None]), -1)  # [Hv, C, dv + dk]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split((v.shape[-1], k.shape[-1]), -1)
    delta = u - w @ state  # [Hv, C, dv]: the d_i above

    out = (q * gamma.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ delta
    last = gamma[:, -1:]  # [Hv, 1]: padding rows have g = 0, so this is the last real token's
    k_to_end = k * (last - gamma).exp()[..., None]  # [Hv, C, dk]
    state = state * last.exp()[..., None] + k_to_end.transpose(-1, -2) @ delta
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk] (before l2 normalisation)
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv] log decays, <= 0
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, dk, dv] the state before the call (any float dtype)
    start: int = 0,  # absolute position of the call's first token: anchors the chunk grid
    chunk: int = CHUNK,
    round_state: Callable[[torch.Tensor], torch.Tensor] | None = None,  # a quantized storage's rounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens, chunk by chunk in order. Returns the outputs [T, Hv, dv] (v's dtype)
    and the float32 state after the last token [Hv, dk, dv]. `round_state` is applied at every chunk end before
    the last (grid points: where a split prefill would store the state, `models/state_store`)."""
    t, hv, dv = v.shape
    dk = k.shape[-1]
    s = state.to(torch.float32)
    out = v.new_empty(t, hv, dv)
    for a, b in chunk_bounds(start, t, chunk):
        if a > 0 and round_state is not None:
            s = round_state(s)
        qc, kc, vc, gc, bc = (_padded(x, a, b, chunk) for x in (q, k, v, g, beta))
        qc = _expand_heads(l2norm(qc) * dk**-0.5, hv)  # [C, Hv, dk]
        kc = _expand_heads(l2norm(kc), hv)
        heads_first = (x.transpose(0, 1).contiguous() for x in (qc, kc, vc, gc, bc))  # [Hv, C, ...]
        oc, s = _chunk(*heads_first, s)
        out[a:b] = oc[:, : b - a].transpose(0, 1)
    return out, s


def step_inputs(
    q: torch.Tensor,  # [T, Hk, dk]
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
) -> tuple[torch.Tensor, ...]:
    """The one-token step's float32 inputs, row by row: q (normalised, scaled) and k (normalised) expanded to the
    value heads [T, Hv, dk], v [T, Hv, dv], the decay exp(g) and beta [T, Hv], all contiguous."""
    hv, dk = v.shape[1], k.shape[-1]
    qs = _expand_heads(l2norm(q.to(torch.float32)) * dk**-0.5, hv)
    ks = _expand_heads(l2norm(k.to(torch.float32)), hv)
    rest = (v.to(torch.float32), g.to(torch.float32).exp(), beta.to(torch.float32))
    return tuple(x.contiguous() for x in (qs, ks, *rest))


def gated_delta_step(
    q: torch.Tensor,  # [N, Hv, dk] float32, from `step_inputs`
    k: torch.Tensor,  # [N, Hv, dk]
    v: torch.Tensor,  # [N, Hv, dv]
    decay: torch.Tensor,  # [N, Hv] exp(g)
    beta: torch.Tensor,  # [N, Hv]
    state: torch.Tensor,  # [N, Hv, dk, dv] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of N independent requests (the decode step). With S the state decayed (decay * S):
        pred = sum_i S[i] k_i;  delta = (v - pred) beta;  S'[i] = S[i] + k_i delta;  out = sum_i q_i S'[i],
    the sums over i in index order, one rounding per operation: the exact float32 operations of the native
    in-pool kernel (`runner/kernels/state_step.cpp`), so both give a request the same bits, whatever the batch.
    Returns out [N, Hv, dv] and S' [N, Hv, dk, dv]."""
    decayed = state * decay[..., None, None]
    pred = torch.zeros_like(v)
    for i in range(k.shape[-1]):
        pred = pred + decayed[:, :, i] * k[:, :, i, None]
    delta = (v - pred) * beta[..., None]
    new = decayed + k[..., :, None] * delta[..., None, :]
    out = torch.zeros_like(v)
    for i in range(q.shape[-1]):
        out = out + q[:, :, i, None] * new[:, :, i]
    return out, new


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk]
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [Hv, dk, dv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule one token at a time (`gated_delta_step`; the decode path, where T is 1). Returns outputs
    [T, Hv, dv] (v's dtype) and the float32 state [Hv, dk, dv]."""
    s = state.to(torch.float32)[None]
    qs, ks, vs, decay, bs = step_inputs(q, k, v, g, beta)
    out = v.new_empty(v.shape)
    for i in range(v.shape[0]):
        o, s = gated_delta_step(qs[i : i + 1], ks[i : i + 1], vs[i : i + 1], decay[i : i + 1], bs[i : i + 1], s)
        out[i] = o[0]
    return out, s[0]


__all__ = [
    "CHUNK",
    "causal_conv1d",
    "chunk_bounds",
    "chunk_gated_delta_rule",
    "gated_delta_step",
    "l2norm",
    "recurrent_gated_delta_rule",
    "step_inputs",
]
