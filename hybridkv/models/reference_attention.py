"""An obviously correct AttentionFn for one sequence, with a contiguous KV store per layer: the oracle the paged
attention of the runner is tested against.

Masking follows transformers: causal, and on a layer with sliding window W the token at position p sees the
positions p - W + 1 .. p (itself and the W - 1 before it). A KV-sharing consumer stores nothing and reads its
target's KV, which the target stored earlier in the same forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class ReferenceAttention:
    """Call it for every layer of every forward pass of one sequence, whose tokens arrive in order (a prefill,
    then one or more tokens at a time): the new tokens take the positions right after those already stored."""

    def __init__(self, layer_windows: Sequence[int | None], kv_sharing: Mapping[int, int]) -> None:
        self.layer_windows = list(layer_windows)
        self.kv_sharing = dict(kv_sharing)
        self.k: dict[int, torch.Tensor] = {}  # layer -> [T, num_kv_heads, head_size]
        self.v: dict[int, torch.Tensor] = {}

    @classmethod
    def for_model(cls, model: object) -> ReferenceAttention:
        """For a model that exposes `layer_windows` and `kv_sharing` (all of ours do)."""
        return cls(model.layer_windows, model.kv_sharing)

    def __call__(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        source = self.kv_sharing.get(layer, layer)
        if source != layer and kv is not None:
            raise ValueError(f"layer {layer} reads the KV of layer {source}: it must pass kv=None")
        if source == layer and kv is None:
            raise ValueError(f"layer {layer} owns its KV: it must pass kv")
        if kv is not None:
            k, v = kv.unbind(1)
            self.k[layer] = k if layer not in self.k else torch.cat([self.k[layer], k])
            self.v[layer] = v if layer not in self.v else torch.cat([self.v[layer], v])
        keys, values = self.k[source], self.v[source]

        n, t = q.shape[0], keys.shape[0]
        q_pos = torch.arange(t - n, t, device=q.device)[:, None]
        k_pos = torch.arange(t, device=q.device)[None, :]
        visible = k_pos <= q_pos
        window = self.layer_windows[layer]
        if window is not None:
            visible &= k_pos > q_pos - window

        group = q.shape[1] // keys.shape[1]  # query head h reads KV head h // group
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head, dropped after the softmax
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, n, 1)], -1)
        probs = torch.softmax(scores, dim=-1)[..., :t]
        return torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
