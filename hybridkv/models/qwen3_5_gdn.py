"""Qwen3.5's Gated DeltaNet layer: in_proj (qkv, z, b, a) -> causal conv -> silu -> the gated delta rule per
request (in the pool for one-token requests, `RecurrentStates.in_place`) -> gated RMSNorm by z -> out_proj.
Exactness in float32 as `qwen3_5.py` says; in bfloat16 the projections run packed and the elementwise work around
them runs in `kernels/gdn_ops.cpp` (one call for the gates, one for a one-token step's inputs, one for the output
norm), rows independent, so every path gives a token the same bits."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridkv.models import exact
from hybridkv.models import gated_deltanet as gdn
from hybridkv.models.base import RecurrentStates
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.linear import Linear, project, project_fused
from hybridkv.models.state_store import round_state
from hybridkv.native import load_kernel

Shape = tuple[int, ...]
SOURCE = Path(__file__).parent / "kernels" / "gdn_ops.cpp"


class GatedRMSNorm(nn.Module):
    """The GDN output norm: x / rms(x) * weight (not 1 + weight), then * silu(z); over each head's dv."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * exact.rms_scale(xf, self.eps)
        return (self.weight * xf.to(x.dtype) * exact.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj_qkv -> causal conv -> silu -> q, k, v; the gated delta rule per request;
    a gated RMSNorm by z; out_proj. Decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_k_heads, self.num_v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        self.head_k_dim, self.head_v_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of {self.num_k_heads}")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # channels q, k, v in this order
        self.kernel = cfg.get("linear_conv_kernel_dim", 4)
        self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, self.num_v_heads, bias=False)
        # Holds the checkpoint's depthwise weight [conv_dim, 1, K]; the conv itself is gdn.causal_conv1d.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg["rms_norm_eps"])
        self.out_proj = Linear(self.value_dim, hidden, bias=False)
        self.in_proj: FusedLinear | None = None  # one matmul for qkv, z, b, a: set by `fuse`
        self.ops: Any = None  # `gdn_ops`, set by `use_fused_ops` (the packed path)
        self._norm_weight: torch.Tensor | None = None  # the output norm's weight in float32, for `gdn_ops`
        self._constants: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def state_shapes(self) -> tuple[Shape, Shape]:
        """(conv [K - 1, conv_dim], recurrent [Hv, dk, dv])."""
        return (self.kernel - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def fuse(self) -> None:
        self.in_proj = FusedLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def use_fused_ops(self, ops: object) -> None:
        """The packed path (bfloat16; `registry.load_model` calls this after packing): the elementwise work in
        `gdn_ops` (kept off without a compiled kernel). Float32 never gets here: its exactness is this module's
        own torch code."""
        self.ops = load_kernel(SOURCE)
        self._norm_weight = self.norm.weight.detach().float().contiguous()

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [n, conv_dim] as q, k [n, Hk, dk] and v [n, Hv, dv]."""
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), -1)
        q = q.view(-1, self.num_k_heads, self.head_k_dim)
        k = k.view(-1, self.num_k_heads, self.head_k_dim)
        return q, k, v.view(-1, self.num_v_heads, self.head_v_dim)

    def forward(self, layer: int, x: torch.Tensor, positions: torch.Tensor, states: RecurrentStates) -> torch.Tensor:
        n, hv = x.shape[0], self.num_v_heads
        if self.in_proj is not None:
            qkv, z, b, a = project_fused(self.in_proj, x).split_with_sizes(self.in_proj.sizes, -1)
        else:
            qkv, z, b, a = (project(p, x) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        taps, decay_rate, dt_bias = self.constants()
        if self.ops is not None:
            g, beta = self.ops.gdn_gates(b, a, decay_rate, dt_bias)  # [N, Hv] float32
        else:  # per head, in float32, token-major and contiguous: [N, Hv]
            beta = exact.sigmoid(b.float().contiguous())
            g = decay_rate * exact.softplus(a.float() + dt_bias)

        out = x.new_empty(n, hv, self.head_v_dim)
        if states.in_place:  # one-token requests, batched, their states stepped in the pool
            starts = [states.spans[r][0] for r in states.in_place]
            # every token one such request: their rows are the call's, in order (no gather)
            rows = slice(None) if len(starts) == n else torch.tensor(starts, device=x.device)
            mixed = states.conv_step(layer, qkv[rows].contiguous(), taps.float())
            out[rows] = states.delta_step(layer, *self._step_inputs(mixed, g[rows], beta[rows])).to(out.dtype)
        stepped = set(states.in_place)
        for r, (t0, t1) in enumerate(states.spans):
            if r in stepped:
                continue
            conv_state, recurrent_state = states.state(layer, r)
            mixed, window = gdn.causal_conv1d(qkv[t0:t1], conv_state, taps)
            conv_state.copy_(window)
            if t1 - t0 == 1:  # the one-token step, as in the pool
                inputs = self._step_inputs(mixed, g[t0:t1], beta[t0:t1])
                o, s = gdn.gated_delta_step(*inputs, recurrent_state.float()[None])
                s = s[0]
            else:  # the chunk grid is anchored at the request's absolute position
                q, k, v = self._heads(exact.silu(mixed))  # [n_r, conv_dim], contiguous
                start = int(positions[t0])
                rounding = round_state(recurrent_state)
                o, s = gdn.chunk_gated_delta_rule(q, k, v, g[t0:t1], beta[t0:t1], recurrent_state, start,
                                                  round_state=rounding)  # fmt: skip
            recurrent_state.copy_(s)
            out[t0:t1] = o
        return self._output(out, z)

    def _step_inputs(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The one-token step's float32 inputs (q, k, v, decay, beta) from the conv's output before silu."""
        if self.ops is not None:
            return (
                *self.ops.gdn_step_inputs(mixed, g.contiguous(), self.num_k_heads, self.head_k_dim),
                beta.contiguous(),
            )
        q, k, v = self._heads(exact.silu(mixed))
        return gdn.step_inputs(q, k, v, g, beta)

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [N, Hv, dv], gated by z [N, value_dim] and normed, through out_proj."""
        n = out.shape[0]
        if self.ops is not None:
            out = self.ops.gated_rms_norm(out, z, self._norm_weight, self.norm.eps)
            return project(self.out_proj, out)
        out = self.norm(out, z.contiguous().view(n, self.num_v_heads, self.head_v_dim))
        return project(self.out_proj, out.reshape(n, self.value_dim))

    def constants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv taps [K, conv_dim] in the weight's dtype, -exp(A_log) and dt_bias in float32 [Hv]): functions of
        the weights alone, made once at the first forward (the weights are final by then)."""
        if self._constants is None:
            taps = self.conv1d.weight[:, 0].t().contiguous()
            self._constants = (taps, -self.A_log.float().exp(), self.dt_bias.float())
        return self._constants
