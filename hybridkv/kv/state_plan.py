"""Where a request's recurrent state lives in the block pool.

Every block id addresses S = `bytes_per_block` bytes, chosen from the attention layers alone, so the attention
block size stays the user's. A request's state for ALL recurrent layers is one byte blob (layer after layer: conv
state, then recurrent state, each 64-byte aligned) cut into m = cdiv(blob_bytes, S) pages. Page j lives in its
own KV cache group, state page group j, with the recurrent-state table semantics (`state.py`): entry e of page
group j is page j of the state checkpoint at entry e. A checkpoint is usable only when all m page groups hold
entry e, which the hit search across groups (`prefix.common_resume_block`) gives for free. A page group owns
no per-layer tensor: its block is all S bytes of the block id, read and written with `KVCacheMemory.read_pages`
/ `write_pages`, and page j of a state is bytes [j * S, (j + 1) * S) of its blob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from hybridkv.kv.spec import cdiv
from hybridkv.kv.state import RecurrentStateSpec, align_up


@dataclass(frozen=True)
class StateSlot:
    """One recurrent layer's place in the state blob: byte offsets of its conv and recurrent state."""

    layer: int
    spec: RecurrentStateSpec
    conv_offset: int
    ssm_offset: int


@dataclass(frozen=True)
class StateLayout:
    """The state blob of one request and the page groups that hold it (group ids `page_groups`, in page order)."""

    page_groups: tuple[int, ...]
    page_bytes: int  # S: the plan's bytes_per_block
    blob_bytes: int
    slots: tuple[StateSlot, ...]  # in layer order, offsets increasing

    def __post_init__(self) -> None:
        if len(self.page_groups) != cdiv(self.blob_bytes, self.page_bytes):
            need = cdiv(self.blob_bytes, self.page_bytes)
            raise ValueError(f"{self.blob_bytes} state bytes in pages of {self.page_bytes} need {need} page groups")

    @property
    def num_pages(self) -> int:
        return len(self.page_groups)

    @property
    def bytes_per_request(self) -> int:
        """Pool bytes one state (checkpoint or live) takes: whole pages."""
        return self.num_pages * self.page_bytes

    @property
    def padding_bytes(self) -> int:
        return self.bytes_per_request - self.blob_bytes

    @property
    def align(self) -> int:
        """Token positions where a prefill may be split or resumed exactly: multiples of the block size (where
        checkpoints sit) and of every scan's chunk size."""
        block_size = self.slots[0].spec.block_size
        return math.lcm(block_size, *(s.spec.chunk_size for s in self.slots))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.slots)

    @cached_property
    def _by_layer(self) -> dict[int, StateSlot]:
        return {s.layer: s for s in self.slots}

    def slot(self, layer: int) -> StateSlot:
        if layer not in self._by_layer:
            raise ValueError(f"layer {layer} keeps no recurrent state; state layers: {list(self.layers)}")
        return self._by_layer[layer]

    def to_dict(self) -> dict:
        return {
            "num_pages": self.num_pages,
            "page_bytes": self.page_bytes,
            "blob_bytes": self.blob_bytes,
            "bytes_per_request": self.bytes_per_request,
            "padding_bytes": self.padding_bytes,
            "align": self.align,
            "page_groups": [self.page_groups[0], self.page_groups[-1]],
            "layers": list(self.layers),
        }


def state_slots(layers: Sequence[tuple[int, RecurrentStateSpec]]) -> tuple[tuple[StateSlot, ...], int]:
    """The blob layout of `layers` (layer, spec) in layer order, and the blob's size in bytes."""
    slots, off = [], 0
    for layer, spec in sorted(layers, key=lambda ls: ls[0]):
        conv = off
        ssm = conv + align_up(spec.conv_bytes)
        off = ssm + align_up(spec.ssm_bytes)
        slots.append(StateSlot(layer, spec, conv, ssm))
    return tuple(slots), off
