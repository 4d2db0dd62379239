"""Paged attention in plain torch: write new K/V into block slots, gather each request's blocks, attend.

Per step, `StepIndex` places the N flat tokens in a padded [B, Lq] query grid; per KV cache group,
`GroupMetadata` holds each new token's (block, slot) and, per request, the blocks its queries may read, so all
layers of a group share one set of index tensors. A sliding-window group gathers only the blocks that the
step's queries can see. Key j (absolute position) is visible to the query at position p when j <= p,
j < seq_len and, for a sliding window W, p - j < W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class IndexPack:
    """The integer index lists of one step, uploaded as one tensor (one host-to-device copy, not one per list);
    each list comes back as a view."""

    def __init__(self) -> None:
        self._parts: list[list[int]] = []
        self._views: list[torch.Tensor] = []

    def add(self, values: list[int]) -> int:
        self._parts.append(values)
        return len(self._parts) - 1

    def upload(self, device: torch.device) -> None:
        flat = torch.tensor([v for part in self._parts for v in part], dtype=torch.long)
        self._views = list(flat.to(device, non_blocking=True).split([len(p) for p in self._parts]))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._views[i]


@dataclass
class StepIndex:
    """Where each flat token sits in the padded [B, Lq] query grid, and the positions involved."""

    starts: list[int]
    lengths: list[int]
    rows: list[int]  # [N]: the request of each token
    positions: list[int]  # [N]
    pack: IndexPack
    _rows: int  # slot of `rows` in the pack
    _q_index: int  # slot of each token's place in its request's query row

    @staticmethod
    def build(starts: list[int], lengths: list[int], pack: IndexPack) -> StepIndex:
        rows = [r for r, n in enumerate(lengths) for _ in range(n)]
        q_index = [j for n in lengths for j in range(n)]
        positions = [starts[r] + j for r, j in zip(rows, q_index)]
        return StepIndex(starts, lengths, rows, positions, pack, pack.add(rows), pack.add(q_index))

    @property
    def req_index(self) -> torch.Tensor:
        return self.pack[self._rows]

    @property
    def q_index(self) -> torch.Tensor:
        return self.pack[self._q_index]

    @property
    def num_reqs(self) -> int:
        return len(self.lengths)

    @property
    def max_q(self) -> int:
        return max(self.lengths)


@dataclass
class GroupMetadata:
    pack: IndexPack
    _block_ids: int  # slot: [N] block of each new token
    _offsets: int  # slot: [N] slot inside that block
    _tables: int  # slot: [B * nb] blocks gathered for attention (0 = null block, always masked)
    num_blocks: int  # nb
    mask: torch.Tensor  # [B, 1, Lq, nb * block_size] additive: 0 where visible, -inf elsewhere

    @property
    def block_ids(self) -> torch.Tensor:
        return self.pack[self._block_ids]

    @property
    def offsets(self) -> torch.Tensor:
        return self.pack[self._offsets]

    @property
    def tables(self) -> torch.Tensor:
        return self.flat_tables.view(-1, self.num_blocks)

    @property
    def flat_tables(self) -> torch.Tensor:
        return self.pack[self._tables]

    @staticmethod
    def build(
        step: StepIndex,
        tables: list[list[int]],
        block_size: int,
        window: int | None,
        device: torch.device,
        masks: dict[tuple, torch.Tensor] | None = None,
    ) -> GroupMetadata:
        """`masks`: masks built earlier in this step, shared by groups with the same window and spans."""
        # Sliding groups read from block `first[b]` on: the block holding the first key any query can see.
        first = [0] * len(tables)
        if window is not None:
            first = [max(0, s - window + 1) // block_size for s in step.starts]
        span = max(len(t) - f for t, f in zip(tables, first))
        gathered = [v for t, f in zip(tables, first) for v in t[f:] + [0] * (span - len(t) + f)]
        # Each new token's block: its table entry, counted from the gathered window's first block.
        block_ids = [gathered[r * span + p // block_size - first[r]] for r, p in zip(step.rows, step.positions)]
        key = (block_size, window, span, *first)
        mask = None if masks is None else masks.get(key)
        if mask is None:
            mask = _mask(step, first, span, block_size, window).to(device)
            if masks is not None:
                masks[key] = mask
        pack = step.pack
        offsets = [p % block_size for p in step.positions]
        return GroupMetadata(pack, pack.add(block_ids), pack.add(offsets), pack.add(gathered), span, mask)


def _mask(step: StepIndex, first: list[int], span: int, block_size: int, window: int | None) -> torch.Tensor:
    """Query i of request b (position q) sees gathered key j when lo <= j <= hi: hi = q - (first key position),
    lo = hi - window + 1 (0 for full attention). A padded query slot sees key 0 only, so softmax stays finite
    (its output is dropped)."""
    lq = step.max_q
    hi, lo = [], []
    for b, (start, n) in enumerate(zip(step.starts, step.lengths)):
        base = first[b] * block_size
        for i in range(lq):
            h = start + i - base if i < n else 0
            hi.append(h)
            lo.append(0 if i >= n or window is None else h - window + 1)
    bounds = torch.tensor([hi, lo]).view(2, len(step.starts), lq, 1)
    k = torch.arange(span * block_size)
    visible = (k <= bounds[0]) & (k >= bounds[1])
    return torch.where(visible, 0.0, float("-inf")).unsqueeze(1)


class Workspace:
    """Gather buffers kept across steps, one per KV cache. A fresh multi-MB tensor every step costs page faults
    on each of its pages (large allocations are mmapped and unmapped again); reusing one buffer does not.
    Buffers over `max_bytes` are not kept."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.buffers: dict[int, torch.Tensor] = {}

    def get(self, key: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        need = math.prod(shape)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(need + need // 2, dtype=dtype, device=device)  # headroom: contexts grow by a token
            if buf.numel() * buf.element_size() <= self.max_bytes:
                self.buffers[key] = buf
        return buf[:need].view(shape)


class PagedAttention:
    """The `AttentionFn` of one step: KV views per layer, metadata per group."""

    def __init__(
        self,
        views: dict[int, torch.Tensor],
        layer_group: dict[int, int],
        metadata: list[GroupMetadata],
        step: StepIndex,
        workspace: Workspace | None = None,
    ) -> None:
        self.workspace = workspace or Workspace()
        self.views = views  # layer -> [num_blocks, block_size, 2, kv_heads, head_size]; consumers alias targets
        self.layer_group = layer_group
        self.metadata = metadata
        self.step = step
        # Gathered K/V per cache, valid for the rest of the step once its owner wrote: consumers reuse them.
        self._gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor | None, scale: float) -> torch.Tensor:
        cache = self.views[layer]
        meta = self.metadata[self.layer_group[layer]]
        if kv is not None:
            cache[meta.block_ids, meta.offsets] = kv if kv.dtype == cache.dtype else kv.to(cache.dtype)
            self._gathered.pop(id(cache), None)
        step = self.step
        keys, values = self._gathered.get(id(cache)) or self._gather(cache, meta)
        hk = keys.shape[1]
        hq = q.shape[1]
        decode = step.max_q == 1  # one query per request, no padding
        if decode:
            # Query heads sharing a KV head become that head's queries: [B, Hk, Hq / Hk, D], and the [B, 1, 1, Lk]
            # mask broadcasts over them. No GQA expansion of K/V.
            qp, hq = q.view(q.shape[0], hk, hq // hk, q.shape[2]), hk
        else:
            qp = q.new_zeros(step.num_reqs, step.max_q, hq, q.shape[2])
            qp[step.req_index, step.q_index] = q
            qp = qp.transpose(1, 2)
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(
            qp,
            keys,
            values,
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=hq != hk,
        )  # [B, Hq, Lq, D]; decode: [B, Hk, Hq / Hk, D]
        if decode:
            return out.view(q.shape)
        return out.transpose(1, 2)[step.req_index, step.q_index]

    def _gather(self, cache: torch.Tensor, meta: GroupMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of `meta.tables` as keys and values [B, Hk, Lk, D]."""
        b, nb = self.step.num_reqs, meta.num_blocks
        _, bs, _, hk, d = cache.shape
        out = self.workspace.get(id(cache), (b * nb, bs, 2, hk, d), cache.dtype, cache.device)
        kv = torch.index_select(cache, 0, meta.flat_tables, out=out).view(b, nb * bs, 2, hk, d)  # K and V
        keys, values = kv.permute(2, 0, 3, 1, 4).unbind(0)
        self._gathered[id(cache)] = (keys, values)
        return keys, values
