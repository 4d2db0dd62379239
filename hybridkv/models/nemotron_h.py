"""Nemotron-H: a stack of single-mixer blocks (Mamba2 'M', attention '*', MLP '-'; MoE 'E' not yet), each
x + mixer(RMSNorm(x)), from `hybrid_override_pattern` (or `layers_block_type`).

Bit-exact in every mode in float32 (bfloat16 makes no bit-for-bit promise and runs packed weights): the Mamba2
chunk scan (`hybridkv.models.mamba2`) cuts at absolute multiples of `chunk_size` and hands its state from chunk to
chunk in order, projections are row-invariant (`hybridkv.models.exact.linear`), and each request of a batch runs
its scan alone. Multi-token calls take the chunk scan, one-token calls the recurrence. dt is clamped to
`time_step_limit` (default (0, inf): no clamp) in both, as in mamba_ssm, vLLM and transformers >= 5.25.
(transformers 5.24 clamped the chunk path alone at `time_step_min`, a value meant only for initialising dt_bias;
5.25 fixed it: see docs/architecture.md, "Oracles".)

Module names mirror transformers' (`layers.3.mixer.in_proj`, `norm_f`, ...) so a checkpoint loads by dropping
`backbone.` (or `model.`). Attention has no RoPE and no biases; the MLP is down(relu(up(x))^2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models import exact
from hybridkv.models.base import AttentionFn, CausalLM, RecurrentStates, embedding
from hybridkv.models.linear import Linear, project
from hybridkv.models.mamba2 import causal_conv, ssd_chunk_scan, ssd_step
from hybridkv.models.norm import RMSNorm
from hybridkv.models.state_store import round_state

MAMBA, ATTENTION, MLP_, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP_, "E": MOE}
ALIASES = {  # older config names -> transformers' current ones
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
DEFAULTS = dict(  # transformers' NemotronHConfig defaults for the fields we read
    head_dim=128,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    mamba_hidden_act="silu",
    conv_kernel=4,
    chunk_size=128,
    time_step_min=0.001,
    time_step_limit=(0.0, float("inf")),
    use_conv_bias=True,
    use_bias=False,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
)


def model_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict with the older field names renamed and transformers' defaults filled in."""
    # Current names win over the older aliases when a config has both (as the KV config reader reads them).
    cfg = {
        **{ALIASES[k]: v for k, v in cfg.items() if k in ALIASES},
        **{k: v for k, v in cfg.items() if k not in ALIASES},
    }
    return DEFAULTS | {k: v for k, v in cfg.items() if v is not None}


def _config_float(value: Any) -> float:
    """A float of a config: a number, or transformers' JSON spelling of a non-finite one ({"__float__": "Infinity"})."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit holds {value!r}: expected two numbers") from None


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Block kinds from `layers_block_type` (a list) or `hybrid_override_pattern` (a string of M * - E)."""
    if cfg.get("layers_block_type"):
        return list(cfg["layers_block_type"])
    return [PATTERN[ch] for ch in cfg["hybrid_override_pattern"]]


class GatedRMSNorm(nn.Module):
    """norm(y * silu(z)), normalized per group of `group_size` channels (float32), then scaled."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n = y.shape[0]
        g = (y.float() * exact.silu(z.float())).view(n, -1, self.group_size)  # [N, groups, group_size]
        g = g * exact.rms_scale(g, self.eps)
        return self.weight * g.view(n, -1).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> (z, xBC, dt); causal conv + silu over xBC -> (x, B, C); SSD; gated norm with z; out_proj.
    The state of each request is read from and written back to `states` in place."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
        self.groups, self.state_size = cfg["n_groups"], cfg["ssm_state_size"]
        self.inner = self.heads * self.head_dim  # I = H * P
        self.conv_dim = self.inner + 2 * self.groups * self.state_size  # channels x | B | C
        self.kernel, self.chunk = cfg["conv_kernel"], cfg["chunk_size"]
        low, high = (_config_float(v) for v in cfg["time_step_limit"])
        self.dt_limit = (low, high)
        if cfg["mamba_hidden_act"] != "silu":
            raise ValueError(f"unsupported mamba_hidden_act {cfg['mamba_hidden_act']!r}; supported: silu")
        bias = cfg["use_bias"]
        self.in_proj = Linear(cfg["hidden_size"], self.inner + self.conv_dim + self.heads, bias=bias)
        self.conv1d = nn.Conv1d(  # a holder of the depthwise weight [conv_dim, 1, K]; never called
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=cfg["use_conv_bias"]
        )
        self.dt_bias = nn.Parameter(torch.zeros(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, cfg["layer_norm_epsilon"])
        self.out_proj = Linear(self.inner, cfg["hidden_size"], bias=bias)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv [K - 1, conv_dim], recurrent [H, P, N])."""
        return (self.kernel - 1, self.conv_dim), (self.heads, self.head_dim, self.state_size)

    def forward(self, layer: int, x: torch.Tensor, states: RecurrentStates, starts: Sequence[int]) -> torch.Tensor:
        h, p, gn = self.heads, self.head_dim, self.groups * self.state_size
        z, xbc, dt = project(self.in_proj, x).split([self.inner, self.conv_dim, h], dim=-1)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, K]
        a = -torch.exp(self.A_log.float())  # [H]
        ys = []
        for r, (t0, t1) in enumerate(states.spans):
            n = t1 - t0
            if n == 0:
                continue
            conv_state, ssm_state = states.state(layer, r)
            u, new_conv = causal_conv(xbc[t0:t1].contiguous(), conv_state, weight, self.conv1d.bias)
            conv_state.copy_(new_conv)
            xs, b, c = exact.silu(u).split([self.inner, gn, gn], dim=-1)
            xs = xs.reshape(n, h, p)
            b, c = b.reshape(n, self.groups, -1), c.reshape(n, self.groups, -1)
            dt_r = exact.softplus(dt[t0:t1].float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [n, H]
            if n == 1:  # the recurrence
                y, new = ssd_step(xs[0], dt_r[0], a, b[0], c[0], self.D, ssm_state.float())
                y = y[None]
            else:  # the chunk scan
                y, new = ssd_chunk_scan(xs, dt_r, a, b, c, self.D, ssm_state.float(), starts[r], self.chunk,
                                        round_state(ssm_state))  # fmt: skip
            ssm_state.copy_(new)
            ys.append(y.reshape(n, self.inner))
        y = self.norm(torch.cat(ys), z, x.dtype)  # [N, I]
        return project(self.out_proj, y)


class Attention(nn.Module):
    """Grouped-query attention without positional encoding (Nemotron-H attention layers have no RoPE)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        self.head_dim, self.scale = hd, hd**-0.5
        self.q_proj = Linear(hidden, heads * hd, bias=False)
        self.k_proj = Linear(hidden, kv_heads * hd, bias=False)
        self.v_proj = Linear(hidden, kv_heads * hd, bias=False)
        self.o_proj = Linear(heads * hd, hidden, bias=False)

    def forward(self, layer: int, x: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        q, k, v = (project(proj, x).view(n, -1, hd) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = attn(layer, q, torch.stack((k, v), 1), self.scale)
        return project(self.o_proj, out.reshape(n, -1))


class MLP(nn.Module):
    """down(relu(up(x))^2), transformers' "relu2"."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        if cfg["mlp_hidden_act"] != "relu2":
            raise ValueError(f"unsupported mlp_hidden_act {cfg['mlp_hidden_act']!r}; supported: relu2")
        bias = cfg["mlp_bias"]
        self.up_proj = Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=bias)
        self.down_proj = Linear(cfg["intermediate_size"], cfg["hidden_size"], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(project(self.up_proj, x)).square()
        return project(self.down_proj, h)


class Block(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg["hidden_size"], cfg["layer_norm_epsilon"])
        self.mixer = {MAMBA: Mamba2Mixer, ATTENTION: Attention, MLP_: MLP}[kind](cfg)


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H over a flat batch. `layer_windows` (all None: full attention) and `kv_sharing` (none) follow
    the other models; `state_shapes()` gives each Mamba2 layer's (conv, recurrent) shapes."""

    packed_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)  # float32 keeps exact sums

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = model_config(cfg)
        kinds = layer_types(cfg)
        if MOE in kinds:
            raise ValueError("nemotron_h: MoE layers are not supported yet")
        self.kinds = kinds
        self.layer_windows: list[int | None] = [None] * len(kinds)
        self.kv_sharing: dict[int, int] = {}
        self.embeddings = embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in kinds)
        self.norm_f = RMSNorm(cfg["hidden_size"], cfg["layer_norm_epsilon"])
        # transformers' NemotronHForCausalLM never ties its head (no tied-weight keys), so neither do we
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def state_shapes(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Mamba2 layer index -> (conv shape, recurrent shape)."""
        return {i: b.mixer.state_shapes() for i, b in enumerate(self.layers) if b.kind == MAMBA}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,
    ) -> torch.Tensor:
        if states is None:
            raise ValueError("nemotron_h has Mamba2 layers: forward needs `states`")
        starts = [int(positions[t0]) if t1 > t0 else 0 for t0, t1 in states.spans]  # anchors of the chunk grid
        x = self.embeddings(input_ids)
        for i, block in enumerate(self.layers):
            h = block.norm(x)
            if block.kind == MAMBA:
                h = block.mixer(i, h, states, starts)
            elif block.kind == ATTENTION:
                h = block.mixer(i, h, attn)
            else:
                h = block.mixer(h)
            x = x + h
        return self.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(self.lm_head, hidden)

    def checkpoint_name(self, name: str) -> str | None:
        """Our state-dict name for a checkpoint tensor (drop `backbone.` / `model.`); None skips it (MTP heads)."""
        if name.startswith("mtp."):
            return None
        return name.removeprefix("backbone.").removeprefix("model.")
