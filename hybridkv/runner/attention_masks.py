"""Which gathered keys each query of a run sees: `Tile`s of queries with additive masks, built once per step and
shared by every layer of a group (and by groups with the same window and spans).

A decode or padded run gathers `width` keys per request: whole blocks, so its last block's tail holds slots the
request has not written, and a sliding group's first block holds keys before the window. Those slots may hold
another group's bytes (one pool serves attention and recurrent-state pages; a state page read as bfloat16 can be
NaN), and a masked key still enters SDPA (0 * NaN = NaN). `Tile.hidden` lists them, so the gather zeroes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.runner.step_index import TILED, Run, StepIndex

MIN_SLIDING_TILE = 64  # smaller tiles would cost more in kernel calls than they save in masked-out keys


@dataclass
class Tile:
    """Queries [q0, q1) of a run attend to its gathered keys [k0, k1) (token offsets from the run's first
    gathered block) under `mask` [B, 1, queries, k1 - k0], additive: 0 where visible, -inf elsewhere. A decode
    or padded run's one tile also lists the gathered slots no query of their request sees, as flat indices into
    [B * width] (`hidden`); a tiled run reads keys [k0, k1) of one request, all written, and lists none."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor
    hidden: torch.Tensor | None = None

    def to(self, device: torch.device) -> Tile:
        hidden = None if self.hidden is None else self.hidden.to(device)
        return Tile(self.q0, self.q1, self.k0, self.k1, self.mask.to(device), hidden)


def run_tiles(step: StepIndex, run: Run, bases: list[int], width: int, window: int | None) -> list[Tile]:
    """A run's tiles. `bases[b]`: position of request b's first gathered key; `width`: keys gathered per request.
    Query i of request b (position q) sees key j when lo <= j <= hi, hi = q - base, lo = hi - window + 1 (0 for
    full attention). A padded query slot sees key 0 only, so softmax stays finite (its output is dropped)."""
    starts, lengths = step.starts[run.r0 : run.r1], step.lengths[run.r0 : run.r1]
    if run.kind != TILED:
        hi: list[int] = []
        for start, n, base in zip(starts, lengths, bases):
            hi += range(start - base, start - base + n)
            hi += [0] * (run.max_q - n)
        lo = [0] * len(hi) if window is None else _window_starts(hi, lengths, run.max_q, window)
        mask = _band(hi, lo, (run.num_reqs, run.max_q), 0, width)
        return [Tile(0, run.max_q, 0, width, mask, _hidden(mask))]
    (start,), (n,), (base,) = starts, lengths, bases
    # A sliding tile of t queries reads t + window - 1 keys: tiles near the window's size waste little.
    size = step.tile if window is None else min(step.tile, max(window, MIN_SLIDING_TILE))
    tiles = []
    for q0 in range(0, n, size):
        q1 = min(n, q0 + size)
        hi = list(range(start + q0 - base, start + q1 - base))
        lo = [0] * len(hi) if window is None else [max(0, h - window + 1) for h in hi]
        k0, k1 = lo[0], hi[-1] + 1
        tiles.append(Tile(q0, q1, k0, k1, _band(hi, lo, (1, q1 - q0), k0, k1 - k0)))
    return tiles


def _hidden(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices into [B * width] of the keys that no query slot of their request sees under `mask`."""
    seen = (mask == 0).any(dim=2).view(-1)  # [B * width]
    return (~seen).nonzero().view(-1)


def _window_starts(hi: list[int], lengths: list[int], max_q: int, window: int) -> list[int]:
    """lo per slot of a padded [B, max_q] grid: hi - window + 1 for real queries, 0 for padding."""
    return [h - window + 1 if i % max_q < lengths[i // max_q] else 0 for i, h in enumerate(hi)]


def _band(hi: list[int], lo: list[int], shape: tuple[int, int], k0: int, width: int) -> torch.Tensor:
    """[B, 1, Lq, width] additive mask: key k0 + j visible to query slot (b, i) iff lo <= k0 + j <= hi. Keys
    [max(lo), min(hi)] are visible to every slot (a full-attention tile's whole prefix) and are left at 0:
    only the columns around them are compared."""
    mask = torch.zeros(shape[0], 1, shape[1], width)
    bounds = torch.tensor([hi, lo]).view(2, shape[0], 1, shape[1], 1) - k0
    shared = (max(max(lo) - k0, 0), min(min(hi) - k0 + 1, width))
    for a, b in ((0, shared[0]), (shared[1], width)) if shared[0] < shared[1] else ((0, width),):
        k = torch.arange(a, b)
        mask[..., a:b].masked_fill_((k > bounds[0]) | (k < bounds[1]), float("-inf"))
    return mask
