"""KVCacheMemory: the plan's buffers on a device and one strided view per layer.

A layer's view has shape [num_blocks, block_size, 2, num_kv_heads, head_size] (2 = K, V; token-major, so one
gather of whole blocks yields keys and values as views): block b of the view starts `offset + b * block_stride`
bytes into its buffer. KV-sharing consumers get their target's view object.
"""

from __future__ import annotations

import torch

from hybridkv.kv.plan import KVPlan


class KVCacheMemory:
    def __init__(self, plan: KVPlan, device: str | torch.device = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.buffers = [torch.zeros(size, dtype=torch.uint8, device=self.device) for size in plan.buffer_sizes]
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

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)
