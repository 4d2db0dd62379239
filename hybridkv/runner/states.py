"""PagedStates: the `RecurrentStates` of one step over the block pool's state pages.

A request's recurrent state, for all recurrent layers, is one byte blob cut into `layout.num_pages` pages, held
by one bundle of the state group. For a chunk of tokens [start, end) the scheduler names two entries by their
bundle heads (`ScheduledChunk.state_entries`; the runner's bundle table holds each head's pages):
  source entry       cdiv(start, bs) - 1   the state after `start` tokens (none when start == 0: zeros);
  destination entry  cdiv(end, bs) - 1     where the state after `end` tokens goes.
They are the same entry while a request decodes inside one block, and the destination is a fresh block once the
chunk crosses a block end, so a published entry (a checkpoint, possibly shared by other requests) is never written
(`kv.state` holds the table rules).

Two ways through a step (the same bits either way: `models.gated_deltanet.gated_delta_step`):
  in place   a one-token chunk that keeps its state, with the native kernel and a model that steps states in
             the pool (`steps_states_in_place`): each layer reads the source entry's bytes where they live and
             writes the destination's (`state_step.cpp`). No copy of the state beyond the step's own read and
             write; the copy-on-write at a block end is that same read and write, to other pages.
  gathered   any other chunk (prefill chunks, a prefiller's last token, torch-only runs): the source pages are
             copied into a row of `blobs`, layers work on views of it, `write_back` stores the row in the
             destination pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import StateLayout
from hybridkv.models.state_store import Int8Rows
from hybridkv.request.batch import ScheduledChunk


class PagedStates:
    """The `RecurrentStates` of one step over the block pool: requests in `in_place` are stepped where their
    states live (`conv_step`, `delta_step`); every other request gets one row of a [R', num_pages * page_bytes]
    byte tensor, typed views into its slots (`state`) and a `write_back` to its destination pages."""

    def __init__(
        self,
        layout: StateLayout,
        memory: KVCacheMemory,
        bundle_pages: torch.Tensor,  # [num_blocks, m]: row h holds the pages of the bundle headed by h
        chunks: Sequence[ScheduledChunk],
        spans: Sequence[tuple[int, int]],
        kernel: object | None = None,  # `kernels.state_step()`, for a model that steps states in place
    ) -> None:
        self.layout = layout
        self.memory = memory
        self.spans = list(spans)
        self.kernel = kernel
        self._slots = {s.layer: s for s in layout.slots}
        in_place: list[int] = []
        gathered: list[int] = []
        blocks = bundle_pages.shape[0]
        for r, chunk in enumerate(chunks):
            source, dest = chunk.state_entries
            if not (0 <= dest < blocks and -1 <= source < blocks) or (chunk.start > 0) != (source >= 0):
                raise ValueError(f"request {chunk.request_id}: bad state entries {chunk.state_entries}")
            if kernel is not None and len(chunk.token_ids) == 1 and chunk.keep_state and source >= 0:
                in_place.append(r)
            else:
                gathered.append(r)
        self.in_place = tuple(in_place)
        self._row = {r: i for i, r in enumerate(gathered)}  # request index -> its row of `blobs`
        heads = torch.tensor([c.state_entries for c in chunks], dtype=torch.long).view(-1, 2)  # [R, (src, dst)]
        if in_place:
            bases, widths = memory.page_bases()
            rows = torch.tensor(in_place, dtype=torch.long)
            self._src = _addresses(bases, widths, bundle_pages[heads[rows, 0]])
            self._dst = _addresses(bases, widths, bundle_pages[heads[rows, 1]])
            # where each segment (page j, region r) begins in the blob, and the blob's size: [m * regions + 1]
            self._starts = torch.cat((torch.zeros(1, dtype=torch.int64), widths.repeat(layout.num_pages).cumsum(0)))
        self._gather(bundle_pages, heads[torch.tensor(gathered, dtype=torch.long)], [chunks[r] for r in gathered])

    def _gather(self, bundle_pages: torch.Tensor, heads: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        """Copy the gathered requests' source states into `blobs` (zeros at token 0); note where they go back."""
        device = self.memory.device
        pages = self.memory.read_pages(bundle_pages[heads[:, 0].clamp(min=0)].view(-1).to(device))
        self.blobs = pages.view(len(chunks), self.layout.num_pages * self.layout.page_bytes)
        fresh = (heads[:, 0] < 0).to(device)
        if bool(fresh.any()):
            self.blobs[fresh] = 0
        keep = torch.tensor([c.keep_state for c in chunks], dtype=torch.bool)
        self._keep = keep.nonzero().view(-1).to(device)
        self._keep_pages = bundle_pages[heads[keep, 1]].view(-1).to(device)

    def state(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor | Int8Rows]:
        slot = self._slots[layer]
        spec, row = slot.spec, self.blobs[self._row[r]]
        conv = row[slot.conv_offset : slot.conv_offset + spec.conv_bytes].view(spec.dtype).view(spec.conv_shape)
        ssm = row[slot.ssm_offset : slot.ssm_offset + spec.ssm_bytes]
        if spec.ssm_quantized:
            codes = ssm[: math.prod(spec.ssm_shape)].view(torch.int8).view(spec.ssm_shape)
            scales = ssm[spec.ssm_scale_offset :].view(torch.float32).view(spec.ssm_shape[:-1])
            return conv, Int8Rows(codes, scales)
        return conv, ssm.view(spec.ssm_dtype).view(spec.ssm_shape)

    def conv_step(self, layer: int, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        slot = self._slots[layer]
        bf16 = slot.spec.dtype == torch.bfloat16
        return self.kernel.conv_step(x, taps, self._src, self._dst, self._starts, slot.conv_offset, bf16)

    def delta_step(self, layer: int, *inputs: torch.Tensor) -> torch.Tensor:
        slot = self._slots[layer]
        storage = STORAGE_CODES[slot.spec.ssm_dtype]
        return self.kernel.delta_step(*inputs, self._src, self._dst, self._starts, slot.ssm_offset, storage)

    def write_back(self) -> None:
        """Store the gathered states after the step in their destination pages (requests that keep theirs)."""
        if not self._keep.numel():
            return
        kept = self.blobs if self._keep.numel() == self.blobs.shape[0] else self.blobs[self._keep]  # no copy if all
        rows = kept.view(self._keep_pages.numel(), self.layout.page_bytes)
        self.memory.write_pages(self._keep_pages, rows)


def _addresses(bases: torch.Tensor, widths: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[n, m * regions] int64: the address of segment (page j, region r) of each entry's blob (pages [n, m])."""
    return (bases + pages[:, :, None].to(torch.int64) * widths).view(pages.shape[0], -1)


# The native delta step's storage argument per recurrent-state dtype (int8: rows with float32 scales).
STORAGE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def steps_in_place(layout: StateLayout) -> bool:
    """The native step kernel's dtypes: float32, bfloat16 or int8 recurrent states; float32 or bfloat16 conv
    windows."""
    kinds = (torch.float32, torch.bfloat16)
    return all(s.spec.ssm_dtype in STORAGE_CODES and s.spec.dtype in kinds for s in layout.slots)


def check_state_shapes(model_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], layout: StateLayout) -> None:
    """The model's recurrent layers read the shapes the plan gave them (both come from the config, read twice):
    a mismatch is a ValueError naming the layer, before any request runs."""
    planned = {s.layer: (tuple(s.spec.conv_shape), tuple(s.spec.ssm_shape)) for s in layout.slots}
    model = {layer: (tuple(c), tuple(r)) for layer, (c, r) in model_shapes.items()}
    if planned != model:
        wrong = sorted(set(planned) ^ set(model) | {k for k in planned.keys() & model.keys() if planned[k] != model[k]})
        raise ValueError(
            f"the model's recurrent state shapes differ from the KV plan's at layers {wrong} "
            f"(model {[model.get(k) for k in wrong]}, plan {[planned.get(k) for k in wrong]}): the config reader "
            "(hybridkv/kv/hybrid_configs.py) and the model read this config differently"
        )
