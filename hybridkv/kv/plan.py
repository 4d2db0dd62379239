"""KVPlan: the one immutable answer to "where does each layer's KV live". Every component reads it.

Attention layers own pages inside each block id (`KVTensor`s); recurrent layers own a per-request state blob cut
into block-sized pages, held by one state group whose entries are bundles of pages (`state_plan.StateLayout`,
re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from hybridkv.kv.layout_names import vllm_layout_name
from hybridkv.kv.spec import AttentionSpec, KVSpec
from hybridkv.kv.state_plan import StateLayout, StateSlot

__all__ = ["KVGroup", "KVPlan", "KVTensor", "StateLayout", "StateSlot"]


@dataclass(frozen=True)
class KVGroup:
    """Layers of one kind that share a block table. A block id of this group owns, for each layer,
    the page at byte `offsets[i]` of the block's `bytes_per_block` span (in the plan's address space).
    The state group has no layers: a table entry is a bundle of `pages_per_entry` block ids, each one page (the
    whole span) of a request's state blob."""

    group_id: int
    spec: KVSpec  # the group's semantics (kind, window, block size); layers may differ in heads/head size
    layers: tuple[int, ...]
    offsets: tuple[int, ...]
    pages: tuple[int, ...]
    pages_per_entry: int = 1  # block ids one table entry stands for: 1, or m for the state group

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def sliding_window(self) -> int | None:
        return self.spec.window_tokens

    @property
    def used_bytes_per_block(self) -> int:
        """Bytes the group's layer pages take (0 for the state group, whose pages take whole blocks)."""
        return sum(self.pages)

    @property
    def is_state(self) -> bool:
        return self.spec.per_request_state


@dataclass(frozen=True)
class KVTensor:
    """A family of per-layer views into buffer `buffer`: block b of each listed layer starts at
    `offset + b * block_stride` bytes. `size` is the buffer's size in bytes."""

    buffer: int
    size: int
    offset: int
    block_stride: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVPlan:
    """Groups, block count, layout and tensors for one model under one memory budget."""

    specs: tuple[KVSpec | None, ...]
    shared: Mapping[int, int]  # consumer layer -> target layer; consumers own no memory
    groups: tuple[KVGroup, ...]
    num_blocks: int  # including the reserved null block 0
    bytes_per_block: int  # bytes one block id addresses, summed over the group's layers (padded to the max)
    layout: str  # "per_layer" | "packed"
    tensors: tuple[KVTensor, ...]
    buffer_sizes: tuple[int, ...]
    max_model_len: int
    max_num_batched_tokens: int
    # Every layer that reads paged KV (KV-sharing consumers included): the layers `group_of`/`tensor_of` answer.
    attention_layers: tuple[int, ...]
    state: StateLayout | None = None  # the recurrent state's blob and group; None without recurrent layers

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def total_bytes(self) -> int:
        return sum(self.buffer_sizes)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.specs if isinstance(s, AttentionSpec))

    def owner(self, layer: int) -> int:
        """The layer whose memory `layer` reads: itself, or its KV-sharing target."""
        return self.shared.get(layer, layer)

    @cached_property
    def _group_of(self) -> dict[int, int]:
        return {layer: g.group_id for g in self.groups for layer in g.layers}

    def group_of(self, layer: int) -> KVGroup:
        """The group of an attention layer (or of its KV-sharing target)."""
        if self.owner(layer) not in self._group_of:
            raise ValueError(f"layer {layer} reads no paged KV (a recurrent or stateless layer): ask plan.state")
        return self.groups[self._group_of[self.owner(layer)]]

    @cached_property
    def _tensor_of(self) -> dict[int, KVTensor]:
        return {layer: t for t in self.tensors for layer in t.layers}

    def tensor_of(self, layer: int) -> KVTensor:
        """The tensor of an attention layer (or of its KV-sharing target)."""
        if self.owner(layer) not in self._tensor_of:
            raise ValueError(f"layer {layer} reads no paged KV (a recurrent or stateless layer): ask plan.state")
        return self._tensor_of[self.owner(layer)]

    def page_regions(self) -> list[tuple[int, int]]:
        """(buffer, width) of every region of a block id, in offset order: one region of S bytes when packed,
        one per buffer per-layer (a plan with state allocates every region, so they tile [0, S))."""
        if self.layout == "packed":
            return [(0, self.bytes_per_block)]
        return [(b, size // self.num_blocks) for b, size in enumerate(self.buffer_sizes)]

    @property
    def blocks_per_request(self) -> int:
        """Blocks one decoding request of `max_model_len` tokens holds, summed over groups."""
        return sum(g.spec.blocks_held(self.max_model_len) * g.pages_per_entry for g in self.groups)

    @property
    def blocks_admitted_per_request(self) -> int:
        """Blocks one request may hold while a whole `max_num_batched_tokens` chunk is in flight."""
        n, chunk = self.max_model_len, self.max_num_batched_tokens
        return sum(g.spec.blocks_admitted(n, chunk) * g.pages_per_entry for g in self.groups)

    @property
    def max_concurrency(self) -> float:
        """Requests of `max_model_len` tokens that decode at once, with room kept for one prefill chunk."""
        reserve = self.blocks_admitted_per_request - self.blocks_per_request
        return max(0.0, (self.num_blocks - 1 - reserve) / self.blocks_per_request)

    @property
    def max_concurrency_conservative(self) -> float:
        """The same, if every request had a whole prefill chunk in flight at once (vLLM's accounting)."""
        return (self.num_blocks - 1) / self.blocks_admitted_per_request

    def block_spans(self, group_id: int, block_id: int) -> list[tuple[int, int, int]]:
        """(buffer, byte start, byte length) regions holding block `block_id` of group `group_id`, merged where
        contiguous: one region when packed, one per layer page (or run of adjacent pages) otherwise. For the state
        group `block_id` is one page (one block id of a bundle): all S bytes of it, one span per region."""
        group = self.groups[group_id]
        if group.is_state:
            return [(b, block_id * width, width) for b, width in self.page_regions()]
        spans: list[tuple[int, int, int]] = []
        for layer, page in zip(group.layers, group.pages, strict=True):
            t = self.tensor_of(layer)
            start = t.offset + block_id * t.block_stride
            if spans and spans[-1][0] == t.buffer and spans[-1][1] + spans[-1][2] == start:
                spans[-1] = (t.buffer, spans[-1][1], spans[-1][2] + page)
            else:
                spans.append((t.buffer, start, page))
        return spans

    def descriptors_per_block(self, group_id: int) -> int:
        """Contiguous regions one block of the group spans (the same for every block id)."""
        return len(self.block_spans(group_id, 1 if self.num_blocks > 1 else 0))

    def to_dict(self) -> dict:
        """A JSON-ready summary: what `hybridkv plan --json` prints and what peers compare."""
        return {
            "num_blocks": self.num_blocks,
            "layout": self.layout,
            "vllm_layout": vllm_layout_name(self.layout),
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "total_bytes": self.total_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "blocks_per_request": self.blocks_per_request,
            "blocks_admitted_per_request": self.blocks_admitted_per_request,
            "max_concurrency": round(self.max_concurrency, 4),
            "max_concurrency_conservative": round(self.max_concurrency_conservative, 4),
            "groups": self._groups_dict(),
            "attention_layers": list(self.attention_layers),
            "state": None if self.state is None else self.state.to_dict(),
            "shared_layers": {str(c): t for c, t in sorted(self.shared.items())},
            "stateless_layers": [i for i, s in enumerate(self.specs) if s is None and i not in self.shared],
            "tensors": [
                {
                    "buffer": t.buffer,
                    "size": t.size,
                    "offset": t.offset,
                    "block_stride": t.block_stride,
                    "layers": list(t.layers),
                }
                for t in self.tensors
            ],
            "buffer_sizes": list(self.buffer_sizes),
        }

    def _groups_dict(self) -> list[dict]:
        """One entry per group; the state group's lists all its layers."""
        out: list[dict] = [
            {
                "group_id": g.group_id,
                "kind": g.kind,
                "sliding_window": g.sliding_window,
                "block_size": g.block_size,
                "layers": list(g.layers),
                "offsets": list(g.offsets),
                "used_bytes_per_block": g.used_bytes_per_block,
                "descriptors_per_block": self.descriptors_per_block(g.group_id),
            }
            for g in self.groups
            if not g.is_state
        ]
        if self.state is not None:
            first = self.state.group
            out.append(
                {
                    "group_id": first,
                    "pages_per_entry": self.state.num_pages,
                    "kind": self.groups[first].kind,
                    "sliding_window": None,
                    "block_size": self.block_size,
                    "layers": list(self.state.layers),
                    "offsets": [],
                    "used_bytes_per_block": self.bytes_per_block,
                    "descriptors_per_block": self.descriptors_per_block(first),
                }
            )
        return out
