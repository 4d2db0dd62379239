"""Physical layouts: which buffers exist and where each layer's pages sit in them.

Every group addresses the same `bytes_per_block` (S) bytes per block id; a group's layers sit at byte offsets
inside those S bytes. The layout maps (block b, offset o) to a buffer address:

- packed:    one buffer of S * num_blocks bytes; (b, o) -> b * S + o. All layers of a block are contiguous.
- per_layer: the S bytes are cut at offsets where every group has a layer boundary; each cut region [a, c)
             is its own buffer with block stride c - a; (b, o) -> region(o), b * (c - a) + (o - a).
             With uniform pages this is one buffer per slot, each shared by one layer of every group.

The state group (`state_plan`) owns whole block ids and no layer page: it does not constrain the cuts, but it
makes every byte of every block id live, so a plan with state allocates every region, layers or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from hybridkv.kv.layout_names import KV_LAYOUTS, normalize_layout
from hybridkv.kv.plan import KVGroup, KVTensor
from hybridkv.kv.spec import KVSpec

__all__ = ["KV_LAYOUTS", "normalize_layout"]  # the names live in layout_names (kv.plan reads them too)
CROSS_LAYERS_KEY = "enable_cross_layers_blocks"


def parse_bool_option(value: Any, key: str) -> bool:
    """A bool, or the strings true/false in any case. Anything else is an error naming `key`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{key} must be true or false (a JSON bool or the string 'true'/'false'), got {value!r}")


def cross_layers_enabled(extra_config: Mapping[str, Any] | None) -> bool:
    """Read `kv_connector_extra_config.enable_cross_layers_blocks` (default false)."""
    if not extra_config or CROSS_LAYERS_KEY not in extra_config:
        return False
    return parse_bool_option(extra_config[CROSS_LAYERS_KEY], f"kv_connector_extra_config.{CROSS_LAYERS_KEY}")


def choose_layout(requested: str, cross_layers: bool, groups: Sequence[KVGroup], specs: Sequence[KVSpec]) -> str:
    """`auto` is packed when cross-layer blocks are enabled on a multi-group model, and always when all
    specs are one uniform type whose page sizes differ. `per-layer` and `packed` force a layout."""
    requested = normalize_layout(requested)
    if requested != "auto":
        return requested.replace("-", "_")
    uniform_type = len({s.group_key for s in specs}) == 1
    mixed_pages = len({s.page_size_bytes for s in specs}) > 1
    packed = (cross_layers and len(groups) > 1) or (uniform_type and mixed_pages)
    return "packed" if packed else "per_layer"


def _packed(groups: Sequence[KVGroup], bytes_per_block: int, num_blocks: int) -> list[KVTensor]:
    size = bytes_per_block * num_blocks
    at: dict[int, list[int]] = {}
    for g in groups:
        for layer, off in zip(g.layers, g.offsets, strict=True):
            at.setdefault(off, []).append(layer)
    return [KVTensor(0, size, off, bytes_per_block, tuple(at[off])) for off in sorted(at)]


def _region_cuts(groups: Sequence[KVGroup], bytes_per_block: int) -> list[int]:
    """Offsets in [0, S] where no group's layer page is split: every group has a boundary there, or
    the offset lies in that group's padding tail."""
    candidates = {0, bytes_per_block}
    for g in groups:
        candidates.update(g.offsets)
    cuts = []
    for c in sorted(candidates):
        if all(c in g.offsets or c >= g.used_bytes_per_block for g in groups):
            cuts.append(c)
    return cuts


def _per_layer(
    groups: Sequence[KVGroup], bytes_per_block: int, num_blocks: int, every_region: bool
) -> tuple[list[KVTensor], list[int]]:
    cuts = _region_cuts(groups, bytes_per_block)
    tensors: list[KVTensor] = []
    sizes: list[int] = []
    for start, end in pairwise(cuts):
        width = end - start
        at: dict[int, list[int]] = {}
        for g in groups:
            for layer, off in zip(g.layers, g.offsets, strict=True):
                if start <= off < end:
                    at.setdefault(off - start, []).append(layer)
        if not at and not every_region:
            continue  # no layer uses these bytes and no state page spans them
        buffer = len(sizes)
        sizes.append(width * num_blocks)
        tensors.extend(KVTensor(buffer, width * num_blocks, off, width, tuple(at[off])) for off in sorted(at))
    return tensors, sizes


def build_tensors(
    layout: str, groups: Sequence[KVGroup], bytes_per_block: int, num_blocks: int
) -> tuple[tuple[KVTensor, ...], tuple[int, ...]]:
    """The tensors and buffer sizes of `layout` ("per_layer" or "packed"); buffers in offset order."""
    if layout == "packed":
        return tuple(_packed(groups, bytes_per_block, num_blocks)), (bytes_per_block * num_blocks,)
    every_region = any(g.is_state for g in groups)
    tensors, sizes = _per_layer(groups, bytes_per_block, num_blocks, every_region)
    return tuple(tensors), tuple(sizes)
