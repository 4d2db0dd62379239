"""Paged attention in plain torch: write new K/V into block slots, gather each run's blocks, attend.

Per KV cache group, `GroupMetadata` holds each new token's (block, slot) and, per run of requests (see
`step_index`), the blocks the run gathers and its masks, so all layers of a group share one set of index tensors.
A sliding-window group gathers only the blocks that the step's queries can see. Key j (absolute position) is
visible to the query at position p when j <= p, j < seq_len and, for a sliding window W, p - j < W.

Decode runs on CPU read their keys in place (`kernels/paged_decode.cpp`) when the native kernel is built: no
gather and no mask; so do the prefill runs of a step that is not exact, in bfloat16 on a CPU with AVX512-BF16
(`kernels/paged_prefill.cpp`). Everything else gathers and calls SDPA. On CPU, a tiled full-attention run of a
step that is not exact then attends in two mask-free calls instead of masked tiles: its prefix [0, start)
(visible to every query) and its own keys (causal), merged by their log-sum-exps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.models.buffers import BufferCache
from hybridkv.runner.attention_masks import Tile, run_tiles
from hybridkv.runner.flash import attend, attend_with_lse, prefix_and_causal, with_sinks
from hybridkv.runner.step_index import DECODE, PADDED, TILED, IndexPack, Run, StepIndex

DecodeKernel = Callable[..., torch.Tensor]


@dataclass
class RunKV:
    """One run's view of a group: blocks to gather ([B * num_blocks], 0 = the null block, always masked) and its
    tiles (one covering everything for decode and padded runs). A decode run read in place has no tiles but the
    pack slots of each request's `bases` (position of its first listed block's slot 0) and query `positions`."""

    tables: int  # slot in the step's pack
    num_blocks: int
    tiles: list[Tile]
    in_place: tuple[int, int] | None = None  # slots: bases, positions
    prefill: tuple[int, int, int] | None = None  # read in place by the prefill kernel; slots: bases, starts, offsets
    causal_split: bool = False  # a tiled full-attention run attended as prefix + causal self (no tiles)


@dataclass
class GroupMetadata:
    pack: IndexPack
    _block_ids: int  # slot: [N] block of each new token
    _offsets: int  # slot: [N] slot inside that block
    runs: list[RunKV]  # one per `StepIndex.runs`
    window: int | None = None

    @property
    def block_ids(self) -> torch.Tensor:
        return self.pack[self._block_ids]

    @property
    def offsets(self) -> torch.Tensor:
        return self.pack[self._offsets]

    @staticmethod
    def build(
        step: StepIndex,
        tables: list[list[int]],
        block_size: int,
        window: int | None,
        device: torch.device,
        masks: dict[tuple, list[Tile]] | None = None,
        in_place_decode: bool = False,
        causal_split: bool = False,
        in_place_prefill: bool = False,
    ) -> GroupMetadata:
        """`masks`: tiles built earlier in this step, shared by groups with the same window and spans.
        `in_place_decode`: decode runs will be read in place by the native kernel (they need no masks).
        `causal_split`: tiled full-attention runs of a step that is not exact attend without masks (CPU).
        `in_place_prefill`: the prefill runs of a step that is not exact are read in place by the native kernel."""
        # Sliding groups read from block `first[b]` on: the block holding the first key any query can see.
        first = [0] * len(tables)
        if window is not None:
            first = [max(0, s - window + 1) // block_size for s in step.starts]
        runs = []
        for i, run in enumerate(step.runs):
            reqs = range(run.r0, run.r1)
            span = max(len(tables[r]) - first[r] for r in reqs)
            gathered = [v for r in reqs for v in tables[r][first[r] :] + [0] * (span - len(tables[r]) + first[r])]
            if in_place_decode and run.kind == DECODE:
                bases = step.pack.add([f * block_size for f in first[run.r0 : run.r1]])
                in_place = (bases, step.pack.add(step.starts[run.r0 : run.r1]))
                runs.append(RunKV(step.pack.add(gathered), span, [], in_place))
                continue
            if in_place_prefill and run.kind != DECODE and not step.exact:
                bases = step.pack.add([f * block_size for f in first[run.r0 : run.r1]])
                offsets = list(itertools.accumulate(step.lengths[run.r0 : run.r1], initial=0))
                prefill = (bases, step.pack.add(step.starts[run.r0 : run.r1]), step.pack.add(offsets))
                runs.append(RunKV(step.pack.add(gathered), span, [], prefill=prefill))
                continue
            if causal_split and run.kind == TILED and window is None and not step.exact:
                runs.append(RunKV(step.pack.add(gathered), span, [], causal_split=True))
                continue
            key = (i, block_size, window, span, *first[run.r0 : run.r1])
            tiles = None if masks is None else masks.get(key)
            if tiles is None:
                bases = [f * block_size for f in first[run.r0 : run.r1]]
                tiles = [t.to(device) for t in run_tiles(step, run, bases, span * block_size, window)]
                if masks is not None:
                    masks[key] = tiles
            runs.append(RunKV(step.pack.add(gathered), span, tiles))
        block_ids = [tables[r][p // block_size] for r, p in zip(step.rows, step.positions)]
        offsets = [p % block_size for p in step.positions]
        return GroupMetadata(step.pack, step.pack.add(block_ids), step.pack.add(offsets), runs, window)


class Workspace(BufferCache):
    """Gather buffers kept across steps, one per (KV cache, run), with headroom for contexts that grow by a token a
    step; buffers over `max_bytes` are not kept (`models/buffers.py`)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        super().__init__(max_bytes, headroom=1.5)


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [B, Hk, Lk, D]
KEPT_RUNS = 2  # the workspace keeps the gathers of the first two runs unless tiled: a sorted step's decodes and
# short chunks (a long chunk's gather is large and its compute dwarfs the page faults of a fresh buffer)


class PagedAttention:
    """The `AttentionFn` of one step: KV views per layer, metadata per group."""

    def __init__(
        self,
        views: dict[int, torch.Tensor],
        layer_group: dict[int, int],
        metadata: list[GroupMetadata | None],
        step: StepIndex,
        workspace: Workspace | None = None,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: DecodeKernel | None = None,
        write_kernel: Callable[..., None] | None = None,
    ) -> None:
        self.workspace = workspace or Workspace()
        self.decode_kernel = decode_kernel  # set iff the metadata was built with `in_place_decode`
        self.prefill_kernel = prefill_kernel  # set iff the metadata was built with `in_place_prefill`
        self.write_kernel = write_kernel  # new K/V into their slots (CPU); else advanced indexing
        self.views = views  # layer -> [num_blocks, block_size, 2, kv_heads, head_size]; consumers alias targets
        self.layer_group = layer_group
        self.metadata = metadata
        self.step = step
        # Gathered K/V per cache and run index, valid for the rest of the step once its owner wrote: consumers
        # reuse them.
        self._gathered: dict[int, dict[int, KV]] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.step.runs:  # a step of no requests (no chunk samples): nothing reads the result
            return torch.empty_like(q)
        cache = self.views[layer]
        meta = self.metadata[self.layer_group[layer]]
        if kv is not None:
            if self.write_kernel is not None and kv.dtype == cache.dtype and kv.is_contiguous():
                self.write_kernel(cache, meta.block_ids, meta.offsets, kv)
            else:
                cache[meta.block_ids, meta.offsets] = kv if kv.dtype == cache.dtype else kv.to(cache.dtype)
            self._gathered.pop(id(cache), None)
        gathered = self._gathered.setdefault(id(cache), {})
        outs = []
        for i, (run, r) in enumerate(zip(self.step.runs, meta.runs)):
            if r.in_place is not None:
                outs.append(self._decode_in_place(cache, run, r, q[run.t0 : run.t1], scale, meta.window, sinks))
                continue
            if r.prefill is not None:
                tables = self.step.pack[r.tables].view(run.num_reqs, r.num_blocks)
                places = (self.step.pack[s] for s in r.prefill)  # bases, starts, offsets
                qr = q[run.t0 : run.t1].contiguous()
                outs.append(self.prefill_kernel(qr, cache, tables, *places, meta.window or 0, scale, sinks))
                continue
            if i not in gathered:
                gathered[i] = self._gather(cache, i, run, r)
            keys, values = self._as(q.dtype, gathered[i])
            outs.append(ATTEND[run.kind](self, run, r, q[run.t0 : run.t1], keys, values, scale, sinks))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_in_place(
        self,
        cache: torch.Tensor,
        run: Run,
        r: RunKV,
        q: torch.Tensor,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        tables = self.step.pack[r.tables].view(run.num_reqs, r.num_blocks)
        bases, positions = (self.step.pack[s] for s in r.in_place)
        return self.decode_kernel(q.contiguous(), cache, tables, bases, positions, window or 0, scale, sinks)

    @staticmethod
    def _as(dtype: torch.dtype, kv: KV) -> KV:
        return kv if kv[0].dtype == dtype else (kv[0].to(dtype), kv[1].to(dtype))

    def _gather(self, cache: torch.Tensor, index: int, run: Run, r: RunKV) -> KV:
        """The run's blocks as keys and values [B, Hk, Lk, D] (views of one token-major copy)."""
        b, nb = run.num_reqs, r.num_blocks
        _, bs, _, hk, d = cache.shape
        tables = self.step.pack[r.tables]
        if index < KEPT_RUNS and run.kind != TILED:
            out = self.workspace.get((id(cache), index), (b * nb, bs, 2, hk, d), cache.dtype, cache.device)
            kv = torch.index_select(cache, 0, tables, out=out)
        else:
            kv = torch.index_select(cache, 0, tables)
        hidden = r.tiles[0].hidden if run.kind != TILED else None
        if hidden is not None and hidden.numel():  # slots no query sees may hold another group's bytes (NaN)
            kv.view(b * nb * bs, -1).index_fill_(0, hidden, 0)
        keys, values = kv.view(b, nb * bs, 2, hk, d).permute(2, 0, 3, 1, 4).unbind(0)
        return keys, values

    def _decode(self, run: Run, r: RunKV, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale, sinks):
        """One query per request: query heads sharing a KV head become that head's queries, [B, Hk, Hq / Hk, D],
        and the [B, 1, 1, Lk] mask broadcasts over them. No GQA expansion of K/V."""
        hk = keys.shape[1]
        qp = q.view(run.num_reqs, hk, q.shape[1] // hk, q.shape[2])
        if sinks is not None:
            out, lse = attend_with_lse(qp, keys, values, r.tiles[0].mask, scale)
            return with_sinks(out, lse, sinks.view(1, hk, -1)).view(q.shape)  # lse [B, Hk, G]
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=r.tiles[0].mask, scale=scale)
        return out.view(q.shape)

    def _padded(self, run: Run, r: RunKV, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale, sinks):
        rows, places = (self.step.pack[s] for s in run.slots)
        qp = q.new_zeros(run.num_reqs, run.max_q, q.shape[1], q.shape[2])
        qp[rows, places] = q
        out = attend(qp.transpose(1, 2), keys, values, r.tiles[0].mask, scale, sinks)  # [B, Hq, max_q, D]
        return out.transpose(1, 2)[rows, places]

    def _tiled(self, run: Run, r: RunKV, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale, sinks):
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if r.causal_split:
            return prefix_and_causal(qt, keys, values, self.step.starts[run.r0], scale, sinks)[0].transpose(0, 1)
        # Exact steps attend fresh copies: a tile's call then gets the same inputs in every mode, down to strides
        # and alignment (its keys are a slice of a gather as long as the chunk's context, which varies).
        take = _fresh if self.step.exact else _view
        outs = [
            attend(take(qt, t.q0, t.q1), take(keys, t.k0, t.k1), take(values, t.k0, t.k1), t.mask, scale, sinks)
            for t in r.tiles
        ]
        return torch.cat(outs, 2)[0].transpose(0, 1)  # [n, Hq, D]


def _view(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x[:, :, a:b]


def _fresh(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    part = x[:, :, a:b]
    return torch.empty(part.shape, dtype=part.dtype, device=part.device).copy_(part)


ATTEND = {DECODE: PagedAttention._decode, PADDED: PagedAttention._padded, TILED: PagedAttention._tiled}
