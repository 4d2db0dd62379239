"""Our Nemotron-H Mamba2 mixer (and the model around it) against an independent float64 reference written from the
equations of Mamba2 / SSD (Dao & Gu 2024, "Transformers are SSMs"), not from transformers and not from our kernels.

Per token t, on the in_proj output split into (z, xBC, dt_raw):
    u_t     = silu(bias + sum_k w[:, k] * xBC_{t - (K-1) + k})      depthwise causal conv, tap K - 1 = current token
    x, B, C = split(u_t)                                            head h reads group h // (H / G)
    dt_t    = clip(softplus(dt_raw_t + dt_bias), time_step_limit)  default limit (0, inf): no clip
    S_t     = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,  A = -exp(A_log)
    y_t     = S_t C_t + D x_t
    out_t   = out_proj(w_norm * g / rms_group(g)),  g = y_t * silu(z_t), rms over groups of I / G channels

`time_step_min` is only the initialisation range of dt_bias (as in the reference mamba_ssm Mamba2 module, NVIDIA's
CUDA path and vLLM, which all pass `time_step_limit`, default (0, inf), to the scan): the reference never clamps dt
at it. transformers <= 5.24 did (`time_step_limit = (time_step_min, inf)`, chunk path only); 5.25 reads
`config.time_step_limit`. The tiny config's dt straddles time_step_min = 0.01, so a clamp there shows.

Tolerance: our mixer runs in float32 (eps 1.2e-7) on outputs of order 1 (max |out| ~ 4, max |logit| ~ 6); its
rounding over a 150-token scan, and through 4 Mamba2 + 2 attention layers, measures ~1e-6 for the mixer and ~3e-6
for the logits, while each real mistake tried (a dropped D, reversed conv taps, the norm before the gate, dt clamped
at time_step_min) moves them by 0.3 or more. 1e-4 leaves a factor of 30 above the rounding and 3000 below the bugs.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

import pytest
import torch

from hybridkv.models.nemotron_h import NemotronHForCausalLM, model_config
from hybridkv.models.reference_attention import ReferenceAttention
from hybridkv.models.reference_states import ReferenceStates
from tests.models.tiny_nemotron_h import NEMOTRON_H_TINY, randomize_nemotron_h

T = 150
TOL = 1e-4
Weights = Mapping[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------
# the reference, float64, one token at a time


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def _softplus(v: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(v))


def _rms(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight


def time_step_limit(cfg: Mapping) -> tuple[float, float]:
    """The clip of dt after softplus: the config's `time_step_limit` (or `mamba_dt_limit`), default none."""
    lo, hi = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, float("inf"))
    return float(lo), float(hi)


@torch.no_grad()
def naive_mixer(
    x: torch.Tensor,  # [T, hidden]
    w: Weights,  # the mixer's tensors under their checkpoint names (in_proj.weight, conv1d.weight, A_log, ...)
    cfg: Mapping,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,  # (last K - 1 conv inputs oldest first, S [H, P, N])
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The Mamba2 mixer over T tokens, token by token in float64. Returns (out [T, hidden], the state after)."""
    f64 = {k: v.detach().to(torch.float64) for k, v in w.items()}
    heads, p, groups, n = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]
    inner, k = heads * p, cfg["conv_kernel"]
    conv_dim = inner + 2 * groups * n
    proj = x.to(torch.float64) @ f64["in_proj.weight"].T
    if "in_proj.bias" in f64:
        proj = proj + f64["in_proj.bias"]
    z, xbc, dt_raw = proj.split([inner, conv_dim, heads], dim=-1)
    taps = f64["conv1d.weight"].reshape(conv_dim, k)  # [channel, tap]
    conv_bias = f64.get("conv1d.bias", torch.zeros(conv_dim, dtype=torch.float64))
    a = -torch.exp(f64["A_log"])
    lo, hi = time_step_limit(cfg)
    group_of_head = torch.arange(heads) // (heads // groups)
    if state is None:
        window = torch.zeros(k - 1, conv_dim, dtype=torch.float64)
        s = torch.zeros(heads, p, n, dtype=torch.float64)
    else:
        window, s = state[0].to(torch.float64), state[1].to(torch.float64)
    ys = []
    for t in range(x.shape[0]):
        window = torch.cat([window, xbc[t : t + 1]])  # K rows, the current token last
        u = _silu(conv_bias + (window.T * taps).sum(-1))
        window = window[1:]
        xs, b, c = u.split([inner, groups * n, groups * n])
        xs = xs.reshape(heads, p)
        b, c = b.reshape(groups, n)[group_of_head], c.reshape(groups, n)[group_of_head]  # [H, N]
        dt = _softplus(dt_raw[t] + f64["dt_bias"]).clamp(lo, hi)  # [H]
        s = torch.exp(dt * a)[:, None, None] * s + dt[:, None, None] * xs[:, :, None] * b[:, None, :]
        ys.append((s * c[:, None, :]).sum(-1) + f64["D"][:, None] * xs)  # [H, P]
    y = torch.stack(ys).reshape(-1, inner)
    g = (y * _silu(z)).reshape(-1, groups, inner // groups)
    g = _rms(g, 1.0, cfg["layer_norm_epsilon"]).reshape(-1, inner) * f64["norm.weight"]
    out = g @ f64["out_proj.weight"].T
    if "out_proj.bias" in f64:
        out = out + f64["out_proj.bias"]
    return out, (window, s)


def block_kinds(cfg: Mapping) -> list[str]:
    """'M' (Mamba2), '*' (attention) or '-' (MLP) per layer, from `layers_block_type` or `hybrid_override_pattern`."""
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-"}
    if cfg.get("layers_block_type"):
        return [names[kind] for kind in cfg["layers_block_type"]]
    return list(cfg["hybrid_override_pattern"])


@torch.no_grad()
def naive_logits(w: Weights, cfg: Mapping, ids: torch.Tensor) -> torch.Tensor:
    """The whole Nemotron-H (no MoE) over one prompt in float64: blocks x + mixer(rms(x)); mixers Mamba2 (above),
    causal GQA attention without positional encoding, down(relu(up x)^2). Tensors under our names (no prefix)."""
    f64 = {k: v.detach().to(torch.float64) for k, v in w.items()}
    eps = cfg["layer_norm_epsilon"]
    x = f64["embeddings.weight"][ids]
    for i, kind in enumerate(block_kinds(cfg)):
        pre = f"layers.{i}.mixer."
        h = _rms(x, f64[f"layers.{i}.norm.weight"], eps)
        if kind == "M":
            h, _ = naive_mixer(h, {k.removeprefix(pre): v for k, v in f64.items() if k.startswith(pre)}, cfg)
        elif kind == "*":
            hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
            q, kk, v = (h @ f64[f"{pre}{name}_proj.weight"].T for name in "qkv")
            q, kk, v = q.view(-1, nq, hd), kk.view(-1, nkv, hd), v.view(-1, nkv, hd)
            kv_head = torch.arange(nq) // (nq // nkv)
            scores = torch.einsum("qhd,khd->hqk", q, kk[:, kv_head]) / hd**0.5
            future = torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            h = torch.einsum("hqk,khd->qhd", probs, v[:, kv_head]).reshape(len(ids), -1) @ f64[f"{pre}o_proj.weight"].T
        else:
            h = torch.relu(h @ f64[f"{pre}up_proj.weight"].T).square() @ f64[f"{pre}down_proj.weight"].T
        x = x + h
    return _rms(x, f64["norm_f.weight"], eps) @ f64["lm_head.weight"].T


# ---------------------------------------------------------------------------------------------------------------
# our model, the same weights

BINDING = 0.01  # the tiny config's time_step_min: dt straddles it
NEVER_BINDS = 1e-9  # below every dt the tiny weights produce


def tiny_config(time_step_min: float) -> dict:
    """The tiny Nemotron-H of tests/models/tiny_nemotron_h.py, in transformers' config field names and defaults."""
    return model_config(NEMOTRON_H_TINY | {"time_step_min": time_step_min})


def tiny_model(time_step_min: float, seed: int = 0) -> NemotronHForCausalLM:
    """Our model, its weights drawn by tests/models/tiny_nemotron_h.py's `randomize_nemotron_h` (the same
    distributions as the transformers tiny model's, not the same values: the draws follow parameter names)."""
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(tiny_config(time_step_min)).eval()
    randomize_nemotron_h(model, seed)
    return model


def hidden_input(seed: int = 5) -> torch.Tensor:
    return torch.randn(T, NEMOTRON_H_TINY["hidden_size"], generator=torch.Generator().manual_seed(seed))


def mixer_weights(model: torch.nn.Module, layer: int) -> dict[str, torch.Tensor]:
    return dict(model.layers[layer].mixer.state_dict())


@torch.no_grad()
def our_mixer(model: NemotronHForCausalLM, layer: int, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Our mixer over x in the pieces [cuts[i], cuts[i+1]), its states carried from piece to piece."""
    mixer = model.layers[layer].mixer
    states = ReferenceStates({layer: mixer.state_shapes()})
    return torch.cat([mixer(layer, x[a:b], states.for_tokens(b - a), [a]) for a, b in pairwise(cuts)])


@torch.no_grad()
def our_logits(model: NemotronHForCausalLM, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Our logits at every prompt position, the prompt fed in the pieces [cuts[i], cuts[i+1])."""
    attn, states, rows = ReferenceAttention.for_model(model), ReferenceStates(model.state_shapes()), []
    for a, b in pairwise(cuts):
        hidden = model(ids[a:b], torch.arange(a, b), attn, states.for_tokens(b - a))
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.to(torch.float64) - ref).abs().max().item()


def prompt_ids() -> torch.Tensor:
    return torch.randint(3, NEMOTRON_H_TINY["vocab_size"], (T,), generator=torch.Generator().manual_seed(1))


DT_MIN = [NEVER_BINDS, BINDING]  # time_step_min only initialises dt_bias: it must change nothing
CUTS = {
    "whole": [0, T],  # one call: the chunk scan for every token
    "pieces": [0, 64, 101, 149, T],  # on and off the chunk grid, then one token (the recurrence)
}


# ---------------------------------------------------------------------------------------------------------------
# tests


def test_reference_is_split_invariant():
    """The reference itself: carrying (conv window, S) across a cut changes nothing."""
    model, x = tiny_model(BINDING), hidden_input()
    cfg, w = tiny_config(BINDING), mixer_weights(model, 0)
    whole, end = naive_mixer(x, w, cfg)
    first, mid = naive_mixer(x[:37], w, cfg)
    second, end2 = naive_mixer(x[37:], w, cfg, mid)
    assert max_diff(torch.cat([first, second]), whole) <= 1e-12
    assert max_diff(end2[1], end[1]) <= 1e-12


def test_tiny_weights_reach_the_regime_that_matters():
    """dt straddles time_step_min (so a clamp there would show) and never reaches NEVER_BINDS."""
    model, x = tiny_model(BINDING), hidden_input()
    mixer = model.layers[0].mixer
    dt_raw = (x @ mixer.in_proj.weight.T)[:, -mixer.heads :]
    dt = torch.nn.functional.softplus(dt_raw + mixer.dt_bias).detach()
    assert dt.min() < BINDING < dt.max()
    assert (dt < BINDING).float().mean() > 0.05
    assert dt.min() > NEVER_BINDS


@pytest.mark.parametrize("cuts", CUTS.values(), ids=CUTS.keys())
@pytest.mark.parametrize("dt_min", DT_MIN)
def test_mixer_matches_the_reference(dt_min, cuts):
    model, x = tiny_model(dt_min), hidden_input()
    ref, _ = naive_mixer(x, mixer_weights(model, 0), tiny_config(dt_min))
    diff = max_diff(our_mixer(model, 0, x, cuts), ref)
    assert diff <= TOL, f"mixer vs float64 reference: max abs difference {diff:.3g} > {TOL}"


@pytest.mark.parametrize("cuts", CUTS.values(), ids=CUTS.keys())
@pytest.mark.parametrize("dt_min", DT_MIN)
def test_logits_match_the_reference(dt_min, cuts):
    model, ids = tiny_model(dt_min), prompt_ids()
    ref = naive_logits(model.state_dict(), tiny_config(dt_min), ids)
    diff = max_diff(our_logits(model, ids, cuts), ref)
    assert diff <= TOL, f"logits vs float64 reference: max abs difference {diff:.3g} > {TOL}"


def test_transformers_matches_the_reference_under_the_configs_limit(tmp_path):
    """transformers' torch path (mixer and logits, whole prompt, no cache) equals the reference once its mixers clip
    dt at the config's `time_step_limit`, which 5.25 does by itself and 5.24 does not (it clips at time_step_min):
    the only place the two versions' CPU math differs."""
    pytest.importorskip("transformers")
    from tests.models.tiny_nemotron_h import build_nemotron_h

    hf = build_nemotron_h(tmp_path, time_step_min=BINDING)
    mixers = [b.mixer for b in hf.model.layers if b.block_type == "linear_attention"]
    for mixer in mixers:
        mixer.time_step_limit = tuple(hf.config.time_step_limit)
    cfg = model_config(hf.config.to_dict())
    weights = {k.removeprefix("model.").removeprefix("backbone."): v for k, v in hf.state_dict().items()}
    x, ids = hidden_input(), prompt_ids()
    with torch.no_grad():
        theirs = mixers[0](x[None])[0]
        their_logits = hf(input_ids=ids[None]).logits[0]
    ref, _ = naive_mixer(x, {k.removeprefix("layers.0.mixer."): v for k, v in weights.items()}, cfg)
    assert max_diff(theirs, ref) <= TOL
    assert max_diff(their_logits, naive_logits(weights, cfg, ids)) <= TOL
