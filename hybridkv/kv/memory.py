"""KVCacheMemory: the plan's buffers on a device and one strided view per layer.

A layer's view has shape [num_blocks, block_size, 2, num_kv_heads, head_size] (2 = K, V; token-major, so one
gather of whole blocks yields keys and values as views): block b of the view starts `offset + b * block_stride`
bytes into its buffer. KV-sharing consumers get their target's view object. Recurrent layers get no view: their
state is read and written as whole block ids (`read_pages` / `write_pages`, the S bytes of each block id in offset
order, whichever the layout), and `state_plan.StateLayout` says which bytes of the pages are which layer's.
"""

from __future__ import annotations

import mmap

import torch

from hybridkv.kv.plan import KVPlan


class KVCacheMemory:
    def __init__(self, plan: KVPlan, device: str | torch.device = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.buffers = [zeroed(size, self.device) for size in plan.buffer_sizes]
        self.views: dict[int, torch.Tensor] = {}
        for t in plan.tensors:
            for layer in t.layers:
                self.views[layer] = self._view(layer, t.buffer, t.offset, t.block_stride)
        for consumer, target in plan.shared.items():
            self.views[consumer] = self.views[target]

    def _view(self, layer: int, buffer: int, offset: int, block_stride: int) -> torch.Tensor:
        spec = self.plan.specs[layer]
        assert spec is not None
        item = spec.dtype.itemsize
        typed = self.buffers[buffer].view(spec.dtype)
        h, d, bs = spec.num_kv_heads, spec.head_size, spec.block_size
        return torch.as_strided(
            typed,
            size=(self.plan.num_blocks, bs, 2, h, d),
            stride=(block_stride // item, 2 * h * d, h * d, d, 1),
            storage_offset=offset // item,
        )

    def layer_view(self, layer: int) -> torch.Tensor:
        return self.views[layer]

    def _regions(self) -> list[torch.Tensor]:
        """Each region of a block id as a [num_blocks, width] byte view, in offset order (they tile S bytes)."""
        n = self.plan.num_blocks
        return [self.buffers[b][: n * width].view(n, width) for b, width in self.plan.page_regions()]

    def page_bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(address of block 0, width) of each region, int64 [regions] each, in offset order: region r of block b
        starts at address base[r] + b * width[r] (CPU memory; the native state step reads and writes there)."""
        regions = self._regions()
        bases = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
        return bases, torch.tensor([r.shape[1] for r in regions], dtype=torch.int64)

    def read_pages(self, block_ids: torch.Tensor) -> torch.Tensor:
        """A copy of the S bytes of each block id: uint8 [len(block_ids), S]."""
        ids = block_ids.to(device=self.device, dtype=torch.long)
        parts = [r.index_select(0, ids) for r in self._regions()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def write_pages(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Store `data` (uint8 [len(block_ids), S]) as the S bytes of each block id; the inverse of `read_pages`.
        Block ids must be distinct (a state page is written by one request)."""
        ids = block_ids.to(device=self.device, dtype=torch.long)
        if data.dtype != torch.uint8 or data.shape != (ids.numel(), self.plan.bytes_per_block):
            raise ValueError(
                f"write_pages takes uint8 [{ids.numel()}, {self.plan.bytes_per_block}], got {data.dtype} "
                f"{list(data.shape)}"
            )
        start = 0
        for region in self._regions():
            width = region.shape[1]
            region.index_copy_(0, ids, data[:, start : start + width].to(self.device))
            start += width

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


def zeroed(size: int, device: torch.device) -> torch.Tensor:
    """`size` zero bytes on `device`. On CPU an anonymous mapping, which the kernel fills with zeros page by page
    as it is first touched: a pool costs resident memory for the blocks requests have used, not for its whole
    budget up front (and starts without writing every byte). The tensor keeps the mapping alive."""
    if device.type != "cpu" or size == 0:
        return torch.zeros(size, dtype=torch.uint8, device=device)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
