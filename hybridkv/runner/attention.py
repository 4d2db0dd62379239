"""Paged attention in plain torch: write new K/V into block slots, gather each request's blocks, attend.

Per step, `StepIndex` places the N flat tokens in a padded [B, Lq] query grid; per KV cache group,
`GroupMetadata` holds each new token's (block, slot) and, per request, the blocks its queries may read, so all
layers of a group share one set of index tensors. A sliding-window group gathers only the blocks that the
step's queries can see. Key j (absolute position) is visible to the query at position p when j <= p,
j < seq_len and, for a sliding window W, p - j < W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepIndex:
    """Where each flat token sits in the padded [B, Lq] query grid, and the positions involved."""

    starts: list[int]
    lengths: list[int]
    req_index: torch.Tensor  # [N] on device
    q_index: torch.Tensor  # [N] on device
    positions: torch.Tensor  # [N] on CPU
    rows: torch.Tensor  # [N] on CPU: the request of each token
    q_pos: torch.Tensor  # [B, Lq] on CPU
    seq_end: torch.Tensor  # [B, 1] on CPU
    pad: torch.Tensor  # [B, Lq] on CPU: padded query slots

    @staticmethod
    def build(starts: list[int], lengths: list[int], device: torch.device) -> StepIndex:
        lens = torch.tensor(lengths)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        first = torch.cumsum(lens, 0) - lens
        q_index = torch.arange(int(lens.sum())) - first[rows]
        start = torch.tensor(starts)
        grid = torch.arange(max(lengths)).unsqueeze(0)
        return StepIndex(
            starts=starts,
            lengths=lengths,
            req_index=rows.to(device),
            q_index=q_index.to(device),
            positions=start[rows] + q_index,
            rows=rows,
            q_pos=start.unsqueeze(1) + grid,
            seq_end=(start + lens).unsqueeze(1),
            pad=grid >= lens.unsqueeze(1),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.lengths)

    @property
    def max_q(self) -> int:
        return max(self.lengths)


@dataclass
class GroupMetadata:
    block_ids: torch.Tensor  # [N] block of each new token
    offsets: torch.Tensor  # [N] slot inside that block
    tables: torch.Tensor  # [B, nb] blocks gathered for attention (0 = null block, always masked)
    mask: torch.Tensor  # [B, 1, Lq, nb * block_size]

    @staticmethod
    def build(
        step: StepIndex, tables: list[list[int]], block_size: int, window: int | None, device: torch.device
    ) -> GroupMetadata:
        # Sliding groups read from block `first[b]` on: the block holding the first key any query can see.
        first = [0] * len(tables)
        if window is not None:
            first = [max(0, s - window + 1) // block_size for s in step.starts]
        span = max(len(t) - f for t, f in zip(tables, first))
        gathered = torch.tensor([t[f:] + [0] * (span - len(t) + f) for t, f in zip(tables, first)])
        # Each new token's block: its table entry, counted from the gathered window's first block.
        block_ids = gathered[step.rows, step.positions // block_size - torch.tensor(first)[step.rows]]
        first_pos = (torch.tensor(first) * block_size).view(-1, 1, 1)
        k_pos = first_pos + torch.arange(span * block_size).view(1, 1, -1)  # [B, 1, Lk] absolute positions
        q_pos = step.q_pos.unsqueeze(-1)  # [B, Lq, 1]
        mask = (k_pos <= q_pos) & (k_pos < step.seq_end.unsqueeze(-1))
        if window is not None:
            mask &= q_pos - k_pos < window
        mask[..., 0] |= step.pad  # padded query rows see one key so softmax stays finite; their output is dropped
        return GroupMetadata(
            block_ids=block_ids.to(device),
            offsets=(step.positions % block_size).to(device),
            tables=gathered.to(device),
            mask=mask.unsqueeze(1).to(device),
        )


class PagedAttention:
    """The `AttentionFn` of one step: KV views per layer, metadata per group."""

    def __init__(
        self,
        views: dict[int, torch.Tensor],
        layer_group: dict[int, int],
        metadata: list[GroupMetadata],
        step: StepIndex,
    ) -> None:
        self.views = views  # layer -> [num_blocks, 2, block_size, kv_heads, head_size]; consumers alias targets
        self.layer_group = layer_group
        self.metadata = metadata
        self.step = step
        # Gathered K/V per cache, valid for the rest of the step once its owner wrote: consumers reuse them.
        self._gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        cache = self.views[layer]
        meta = self.metadata[self.layer_group[layer]]
        if k is not None and v is not None:
            cache[meta.block_ids, :, meta.offsets] = torch.stack((k, v), 1).to(cache.dtype)  # [N, 2, Hk, D]
            self._gathered.pop(id(cache), None)
        step = self.step
        keys, values = self._gathered.get(id(cache)) or self._gather(cache, meta)
        hk = keys.shape[1]
        hq = q.shape[1]
        if step.max_q == 1:  # decode only: one query per request, no padding
            qp = q.unsqueeze(1)
        else:
            qp = q.new_zeros(step.num_reqs, step.max_q, hq, q.shape[2])
            qp[step.req_index, step.q_index] = q
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=hq != hk,
        )  # [B, Hq, Lq, D]
        if step.max_q == 1:
            return out[:, :, 0]
        return out.transpose(1, 2)[step.req_index, step.q_index]

    def _gather(self, cache: torch.Tensor, meta: GroupMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of `meta.tables` as keys and values [B, Hk, Lk, D]."""
        b, nb = meta.tables.shape
        _, _, bs, hk, d = cache.shape
        keys = cache[:, 0][meta.tables].view(b, nb * bs, hk, d).transpose(1, 2)
        values = cache[:, 1][meta.tables].view(b, nb * bs, hk, d).transpose(1, 2)
        self._gathered[id(cache)] = (keys, values)
        return keys, values
