"""Where a request's recurrent state lives in the block pool.

Every block id addresses S = `bytes_per_block` bytes, chosen from the attention layers alone, so the attention
block size stays the user's. A request's state for ALL recurrent layers is one byte blob (layer after layer: conv
state, then recurrent state, each 64-byte aligned) cut into m = cdiv(blob_bytes, S) pages.

The state is ONE KV cache group (`group`), with the recurrent-state table semantics (`state.py`). Its table entry
is a *bundle*: one block id (the bundle's head, what tables, hashes, hits and events see) standing for m block ids
of the shared pool (`BlockPool.get_new_bundle`; the head is one of them). Scheduler, coordinator, prefix cache
and KV events count one entry per block of tokens whatever m is; only code that moves bytes expands an entry to
its pages (the runner's state view, PD descriptors, offload copies):

    table entry e  ->  head block h  ->  pages (p_0, ..., p_{m-1})   page j = bytes [j * S, (j + 1) * S) of the blob

The state group owns no per-layer tensor: a page is all S bytes of its block id, read and written with
`KVCacheMemory.read_pages` / `write_pages`.
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
    """The state blob of one request and the group that holds it (one bundle of `num_pages` pages per entry)."""

    group: int  # the state group's id (after the attention groups)
    num_pages: int  # m: block ids per table entry
    page_bytes: int  # S: the plan's bytes_per_block
    blob_bytes: int
    slots: tuple[StateSlot, ...]  # in layer order, offsets increasing

    def __post_init__(self) -> None:
        if self.num_pages != cdiv(self.blob_bytes, self.page_bytes):
            need = cdiv(self.blob_bytes, self.page_bytes)
            raise ValueError(f"{self.blob_bytes} state bytes in pages of {self.page_bytes} need {need} pages")

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
            "group": self.group,
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
