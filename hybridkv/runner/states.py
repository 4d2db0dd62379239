"""PagedStates: the `RecurrentStates` of one step, gathered from the block pool's state pages and written back.

A request's recurrent state, for all recurrent layers, is one byte blob cut into `layout.num_pages` pages; page j
of the state at table entry e is the block `block_tables[page_groups[j]][e]`. For a chunk of tokens [start, end):
  source entry       cdiv(start, bs) - 1   the state after `start` tokens (none when start == 0: zeros);
  destination entry  cdiv(end, bs) - 1     where the state after `end` tokens goes.
They are the same entry while a request decodes inside one block (the state is updated in place), and the
destination is a fresh block once the chunk crosses a block end, so a published entry (a checkpoint, possibly
shared by other requests) is never written (`kv.state` holds the table rules).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import StateLayout
from hybridkv.kv.spec import cdiv
from hybridkv.request.batch import ScheduledChunk


class PagedStates:
    """Each request's state blob as one row of a [R, num_pages * page_bytes] byte tensor for the step; layers get
    typed views into their slot of it (`state`), and `write_back` stores the rows in the destination pages."""

    def __init__(
        self,
        layout: StateLayout,
        memory: KVCacheMemory,
        chunks: Sequence[ScheduledChunk],
        block_size: int,
        spans: Sequence[tuple[int, int]],
    ) -> None:
        self.layout = layout
        self.memory = memory
        self.spans = list(spans)
        self._slots = {s.layer: s for s in layout.slots}
        m = layout.num_pages
        src: list[int] = []
        self._dst: list[int] = []
        self._keep: list[int] = []  # requests whose state is stored after the step
        fresh: list[int] = []
        for r, chunk in enumerate(chunks):
            end = chunk.start + len(chunk.token_ids)
            source, dest = cdiv(chunk.start, block_size) - 1, cdiv(end, block_size) - 1
            tables = [chunk.block_tables[g] for g in layout.page_groups]
            src += [t[source] for t in tables] if chunk.start > 0 else [0] * m
            if chunk.start == 0:
                fresh.append(r)
            if chunk.keep_state:
                self._keep.append(r)
                self._dst += [t[dest] for t in tables]
        device = memory.device
        pages = memory.read_pages(torch.tensor(src, dtype=torch.long, device=device))
        self.blobs = pages.view(len(chunks), m * layout.page_bytes)
        if fresh:
            self.blobs[torch.tensor(fresh, dtype=torch.long, device=device)] = 0

    def state(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self._slots[layer]
        spec, row = slot.spec, self.blobs[r]
        conv = row[slot.conv_offset : slot.conv_offset + spec.conv_bytes].view(spec.dtype).view(spec.conv_shape)
        ssm = row[slot.ssm_offset : slot.ssm_offset + spec.ssm_bytes].view(spec.ssm_dtype).view(spec.ssm_shape)
        return conv, ssm

    def write_back(self) -> None:
        """Store the states after the step in their destination pages (requests that keep theirs)."""
        if not self._keep:
            return
        device = self.memory.device
        rows = self.blobs[torch.tensor(self._keep, dtype=torch.long, device=device)]
        ids = torch.tensor(self._dst, dtype=torch.long, device=device)
        self.memory.write_pages(ids, rows.view(len(self._keep) * self.layout.num_pages, self.layout.page_bytes))


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
