"""Rotary position embeddings: inverse frequencies for the RoPE types our models use, and their application.

Frequencies follow transformers' `modeling_rope_utils` (computed in float32 on the CPU, cos/sin cast to the
activation dtype), so logits match it in every dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "proportional", "yarn")


def rope_parameters(cfg: Mapping[str, Any], default_theta: float = 10_000.0) -> dict[str, Any]:
    """One flat dict of RoPE parameters, from `rope_parameters` (transformers >= 5) or the older
    `rope_theta` + `rope_scaling` fields."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if params["rope_type"] == "yarn":
        # A top-level `original_max_position_embeddings` (Phi-3 style) wins over the one in the RoPE dict.
        old_len = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = old_len or cfg.get("max_position_embeddings")
        params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    return params


def inv_freq(params: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, on the CPU."""
    rope_type, base = params["rope_type"], params["rope_theta"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    even = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    if rope_type == "proportional":
        # Only the first `partial_rotary_factor` of the angles rotate; the rest get frequency 0 (cos 1, sin 0).
        # The exponent divides by the whole head_dim, not by the rotated part.
        rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        freq = torch.zeros(head_dim // 2, device="cpu")
        freq[:rotated] = 1.0 / (base ** (even[:rotated] / head_dim))
        return freq / params.get("factor", 1.0)
    freq = 1.0 / (base ** (even / head_dim))
    if rope_type == "linear":
        return freq / params["factor"]
    if rope_type == "llama3":
        return _llama3(freq, params)
    if rope_type == "yarn":
        return _yarn(freq, base ** (even / head_dim), params, head_dim)
    return freq


def _llama3(freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(params: Mapping[str, Any]) -> float:
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs give the ratio through the two lengths
        return params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return factor


def _yarn(freq: torch.Tensor, powers: torch.Tensor, params: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): each frequency blends the original (extrapolated) and the `factor`-interpolated
    one, by a ramp over the dimensions between the ones making `beta_fast` and `beta_slow` turns within the
    original context length. `powers`: base ** (2i / head_dim), computed directly (not as 1 / freq)."""
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("yarn RoPE with partial_rotary_factor != 1 is not supported")
    base, old_len = params["rope_theta"], params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the (fractional) dimension whose wavelength fits `turns` times
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (high frequencies), 0: the interpolated one
    return 1.0 / (_yarn_factor(params) * powers) * (1 - keep) + freq * keep


def attention_factor(params: Mapping[str, Any]) -> float:
    """The factor a RoPE type scales its cos/sin tables by: 1 except for yarn."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = _yarn_factor(params), params.get("mscale"), params.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RopeTables:
    """One step's RoPE tables, [N, 1, head_dim]: `cos`, and `sin` with the sign of "rotate half" folded in
    (negative in the first half), so that rope(x) = x * cos + roll(x, head_dim / 2) * sin."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin
        self._heads: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def for_heads(self, rotated: int, unrotated: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [N, rotated + unrotated, head_dim] under which the first `rotated` heads rotate and the rest
        pass through unchanged (cos 1, sin 0): one RoPE call covers stacked q, k and v heads."""
        if not unrotated:
            return self.cos, self.sin
        if (rotated, unrotated) not in self._heads:
            n, _, d = self.cos.shape
            self._heads[rotated, unrotated] = (
                torch.cat((self.cos.expand(n, rotated, d), self.cos.new_ones(n, unrotated, d)), 1),
                torch.cat((self.sin.expand(n, rotated, d), self.sin.new_zeros(n, unrotated, d)), 1),
            )
        return self._heads[rotated, unrotated]


class Rotary:
    """The inverse frequencies of one RoPE; tables for a batch of positions. A plain object, not a module:
    building a model on the meta device or casting it leaves the float32 frequencies alone."""

    def __init__(self, params: Mapping[str, Any], head_dim: int) -> None:
        self.freq = inv_freq(params, head_dim)
        self.scale = attention_factor(params)  # yarn's factor on cos and sin; 1 (no multiply) otherwise

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions [N] -> tables [N, 1, head_dim]."""
        if self.freq.device != positions.device:
            self.freq = self.freq.to(positions.device)
        angles = positions[:, None].float() * self.freq[None, :]
        cos, sin = torch.cat((angles, angles), dim=-1).cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return RopeTables(cos.to(dtype)[:, None], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]: dimension i rotates with i + head_dim/2 ("rotate half"). `cos`, `sin` from
    `RopeTables`. Equal, bit for bit, to x * cos + cat(-x2, x1) * |sin|."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
