"""Planner: model KV specs + a byte budget -> KVPlan.

Grouping. Layers of one group key (kind, block size, window) form a bucket. Every group of every bucket
addresses the same S bytes per block id: a group's layers are packed side by side into S bytes (padding the
rest). All groups keep the user's block size, so a sliding window is never rounded up to a bigger block.
S is chosen among the prefix sums of each bucket's pages to minimise the bytes one `max_model_len` request
holds, fewer groups winning ties. Uniform pages with one bucket give one group of all layers; one full and one
sliding layer give two one-layer groups aliasing one tensor.

Recurrent state. S is chosen from the attention layers alone (so the block size never grows to fit a state);
the states of all recurrent layers form one blob per request, cut into m = cdiv(blob, S) pages: one state group
(id after the attention groups) whose table entries are bundles of m block ids (`state_plan`). The objective
counts those m pages at every S candidate. A model without attention layers gets S = the blob, m = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.kv.layout import build_tensors, choose_layout, normalize_layout
from hybridkv.kv.model_kv import ModelKV, model_kv_from_hf
from hybridkv.kv.plan import KVGroup, KVPlan, StateLayout
from hybridkv.kv.spec import KVSpec, cdiv
from hybridkv.kv.state_plan import state_slots


@dataclass(frozen=True)
class CacheConfig:
    """What the user asks of the KV cache."""

    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int = 2048
    kv_layout: str = "auto"  # auto | per-layer | packed, or vLLM's name of one (`kv.layout_names`)
    enable_cross_layers_blocks: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"KV cache memory must be positive, got {self.memory_bytes} bytes")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        object.__setattr__(self, "kv_layout", normalize_layout(self.kv_layout))


Bucket = list[tuple[int, KVSpec]]


def _buckets(owners: Bucket) -> list[Bucket]:
    by_key: dict[tuple, Bucket] = {}
    for layer, spec in owners:
        by_key.setdefault(spec.group_key, []).append((layer, spec))
    # By the kind's plan order (full attention first), then by first layer: group ids are stable and readable.
    return sorted(by_key.values(), key=lambda b: (b[0][1].plan_order, b[0][0]))


def _pack(bucket: Bucket, capacity: int) -> list[Bucket]:
    """First-fit decreasing by page size; each bin's layers in layer order."""
    bins: list[Bucket] = []
    used: list[int] = []
    for layer, spec in sorted(bucket, key=lambda ls: (-ls[1].page_size_bytes, ls[0])):
        page = spec.page_size_bytes
        for i, u in enumerate(used):
            if u + page <= capacity:
                bins[i].append((layer, spec))
                used[i] += page
                break
        else:
            bins.append([(layer, spec)])
            used.append(page)
    return [sorted(b) for b in sorted(bins, key=lambda b: min(b)[0])]


def _choose_groups(
    buckets: list[Bucket], max_model_len: int, state_blob: int = 0, state_held: int = 0
) -> tuple[int, list[Bucket]]:
    """The block bytes S and the attention groups. A state blob of `state_blob` bytes takes `state_held` bundles
    of cdiv(blob, S) blocks each per request: counted at every candidate S."""
    max_page = max(spec.page_size_bytes for b in buckets for _, spec in b)
    candidates = set()
    for b in buckets:
        total = 0
        for _, spec in b:
            total += spec.page_size_bytes
            if total >= max_page:
                candidates.add(total)
    best: tuple[tuple[int, int], int, list[Bucket]] | None = None
    for capacity in sorted(candidates):
        groups = [g for b in buckets for g in _pack(b, capacity)]
        stride = max(sum(s.page_size_bytes for _, s in g) for g in groups)
        pages = cdiv(state_blob, stride)
        held = sum(g[0][1].blocks_held(max_model_len) for g in groups) + pages * state_held
        key = (stride * held, len(groups) + pages)
        if best is None or key < best[0]:
            best = (key, stride, groups)
    assert best is not None
    return best[1], best[2]


def _make_group(group_id: int, members: Bucket) -> KVGroup:
    offsets, pages, off = [], [], 0
    for _, spec in members:
        offsets.append(off)
        pages.append(spec.page_size_bytes)
        off += spec.page_size_bytes
    return KVGroup(group_id, members[0][1], tuple(lay for lay, _ in members), tuple(offsets), tuple(pages))


def _admitted_blocks(groups: list[KVGroup], num_tokens: int, max_num_batched_tokens: int) -> int:
    return sum(g.spec.blocks_admitted(num_tokens, max_num_batched_tokens) * g.pages_per_entry for g in groups)


def _check_fits(groups: list[KVGroup], stride: int, num_blocks: int, cfg: CacheConfig) -> None:
    """One request of `max_model_len` tokens, with a whole prefill chunk in flight, must fit next to the
    null block; otherwise name the largest `max_model_len` that would."""
    need = _admitted_blocks(groups, cfg.max_model_len, cfg.max_num_batched_tokens)
    if need <= num_blocks - 1:
        return
    lo, hi = 0, cfg.max_model_len  # largest length that fits lies in [lo, hi)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if _admitted_blocks(groups, mid, cfg.max_num_batched_tokens) <= num_blocks - 1:
            lo = mid
        else:
            hi = mid
    need_bytes = (need + 1) * stride
    hint = f"the largest max_model_len that fits is {lo}" if lo else "not even one block fits"
    raise ValueError(
        f"KV cache memory of {cfg.memory_bytes} bytes holds {num_blocks} blocks of {stride} bytes, but one "
        f"request of max_model_len={cfg.max_model_len} needs {need} blocks plus the null block; {hint}. "
        f"Lower max_model_len or raise the memory to at least {need_bytes} bytes."
    )


def plan_kv_cache(model: ModelKV, cfg: CacheConfig) -> KVPlan:
    """Group the model's KV-owning layers, size the block pool from the budget and lay out the tensors."""
    owners = [(layer, spec) for layer in model.owners if (spec := model.specs[layer]) is not None]
    if not owners:
        raise ValueError("the model has no layer that owns KV: nothing to plan")
    block_sizes = {spec.block_size for _, spec in owners}
    if len(block_sizes) > 1:
        raise ValueError(f"all layers must use one block size, got {sorted(block_sizes)}")
    attention = [(layer, spec) for layer, spec in owners if not spec.per_request_state]
    states = [(layer, spec) for layer, spec in owners if spec.per_request_state]
    slots, blob = state_slots(states) if states else ((), 0)
    buckets = _buckets(attention)
    if buckets:
        state_held = states[0][1].blocks_held(cfg.max_model_len) if states else 0
        stride, members = _choose_groups(buckets, cfg.max_model_len, blob, state_held)
    else:  # only recurrent layers: one page holds the whole state
        stride, members = blob, []
    groups = [_make_group(i, m) for i, m in enumerate(members)]
    state = None
    if states:
        # One spec for the state group: the table semantics depend only on the kind and the block size.
        gid, m = len(groups), cdiv(blob, stride)
        groups.append(KVGroup(gid, states[0][1], (), (), (), pages_per_entry=m))
        state = StateLayout(group=gid, num_pages=m, page_bytes=stride, blob_bytes=blob, slots=slots)
    num_blocks = cfg.memory_bytes // stride
    _check_fits(groups, stride, num_blocks, cfg)
    layout = choose_layout(cfg.kv_layout, cfg.enable_cross_layers_blocks, groups, [s for _, s in attention])
    tensors, buffer_sizes = build_tensors(layout, groups, stride, num_blocks)
    attention_layers = sorted([layer for layer, _ in attention] + list(model.shared))
    return KVPlan(
        specs=model.specs,
        shared=dict(model.shared),
        groups=tuple(groups),
        num_blocks=num_blocks,
        bytes_per_block=stride,
        layout=layout,
        tensors=tensors,
        buffer_sizes=buffer_sizes,
        max_model_len=cfg.max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        attention_layers=tuple(attention_layers),
        state=state,
    )


def plan_from_hf_config(
    hf_config: dict,
    cache: CacheConfig,
    *,
    block_size: int = 16,
    dtype: str = "bfloat16",
) -> KVPlan:
    """Hugging Face config dict -> per-layer specs -> plan."""
    return plan_kv_cache(model_kv_from_hf(hf_config, block_size=block_size, dtype=dtype), cache)
