"""Planner: model KV specs + a byte budget -> KVPlan.

Grouping. Layers of one group key (kind, block size, window) form a bucket. Every group of every bucket
addresses the same S bytes per block id: a group's layers are packed side by side into S bytes (padding the
rest). All groups keep the user's block size, so a sliding window is never rounded up to a bigger block.
S is chosen among the prefix sums of each bucket's pages to minimise the bytes one `max_model_len` request
holds, fewer groups winning ties. Uniform pages with one bucket give one group of all layers; one full and one
sliding layer give two one-layer groups aliasing one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.kv.layout import KV_LAYOUTS, build_tensors, choose_layout
from hybridkv.kv.model_kv import ModelKV, model_kv_from_hf
from hybridkv.kv.plan import KVGroup, KVPlan
from hybridkv.kv.spec import KVSpec


@dataclass(frozen=True)
class CacheConfig:
    """What the user asks of the KV cache."""

    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int = 2048
    kv_layout: str = "auto"  # auto | per-layer | packed
    enable_cross_layers_blocks: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"KV cache memory must be positive, got {self.memory_bytes} bytes")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")


Bucket = list[tuple[int, KVSpec]]


def _buckets(model: ModelKV) -> list[Bucket]:
    by_key: dict[tuple, Bucket] = {}
    for layer in model.owners:
        spec = model.specs[layer]
        assert spec is not None
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


def _choose_groups(buckets: list[Bucket], max_model_len: int) -> tuple[int, list[Bucket]]:
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
        held = sum(g[0][1].blocks_held(max_model_len) for g in groups)
        key = (stride * held, len(groups))
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
    return sum(g.spec.blocks_admitted(num_tokens, max_num_batched_tokens) for g in groups)


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
    buckets = _buckets(model)
    if not buckets:
        raise ValueError("the model has no layer that owns KV: nothing to plan")
    block_sizes = {spec.block_size for b in buckets for _, spec in b}
    if len(block_sizes) > 1:
        raise ValueError(f"all layers must use one block size, got {sorted(block_sizes)}")
    stride, members = _choose_groups(buckets, cfg.max_model_len)
    groups = [_make_group(i, m) for i, m in enumerate(members)]
    num_blocks = cfg.memory_bytes // stride
    _check_fits(groups, stride, num_blocks, cfg)
    owner_specs = [s for s in model.specs if s is not None]
    layout = choose_layout(cfg.kv_layout, cfg.enable_cross_layers_blocks, groups, owner_specs)
    tensors, buffer_sizes = build_tensors(layout, groups, stride, num_blocks)
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
