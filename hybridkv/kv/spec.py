"""KV specs: what one layer needs from the KV cache, per block of tokens.

`KVSpec` is the kind interface (block-table semantics: which entries a request holds, what a hit needs);
`AttentionSpec` adds the K/V shape of a paged attention layer. Recurrent-state specs live in `state.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from hybridkv.kv.model_kv import LayerAttn

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown KV dtype {dtype!r}; use one of {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class KVSpec:
    """One layer's cache kind: the table semantics of a group of such layers, per block of `block_size` tokens."""

    kind: ClassVar[str] = "abstract"  # the name its entry in `kinds.CACHE_KINDS` goes by
    # Planner order of the groups (ties by first layer): full attention first, so group ids are stable.
    plan_order: ClassVar[int] = 1
    # Whether a table of this kind may hold a block after a null entry (a recurrent state's tables do: entries a
    # prefill chunk jumps over stay null). False keeps the attention rule "null entries come first".
    interior_nulls: ClassVar[bool] = False
    # Whether the layer keeps one per-request state blob (planned into the state group) rather than pages of its
    # own inside each block id.
    per_request_state: ClassVar[bool] = False
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one layer of this kind takes per block id (an attention page; a state kind's whole state)."""
        raise NotImplementedError

    @property
    def group_key(self) -> tuple:
        """Layers whose keys are equal can share one block table (one KV cache group)."""
        return (self.kind, self.block_size, self.window_tokens)

    @property
    def window_tokens(self) -> int | None:
        return None

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds while it decodes its next token."""
        raise NotImplementedError

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks a request may hold at once, counting a whole prefill chunk in flight (worst case)."""
        raise NotImplementedError

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens at the front that no future token reads: their blocks can be freed."""
        return 0

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first block that a token after the first `num_tokens` tokens reads: table entries
        [0, this) take no block (the null block). Invariants the hit search relies on: nondecreasing in
        `num_tokens`, and first_needed_block(k * block_size) <= k."""
        return self.num_skipped_tokens(num_tokens) // self.block_size

    def resume_block(self, held: Callable[[int], bool], start: int, end: int) -> int:
        """The largest k in [start, end] such that `held(i)` for every block i in
        [max(start, first_needed_block(k * block_size)), k): a request whose blocks [0, start) are present can
        resume at block k when the blocks it reads in [start, k) are held. k = start always qualifies.

        Right to left, asking each block at most once: candidate k fails at its rightmost missing block m, and so
        does every candidate in (m, k) (their needed ranges start no later than k's), so the next candidate is m.
        Subclasses may scan otherwise when that asks fewer blocks; the answer must stay this one."""
        assert 0 <= start <= end, f"resume range [{start}, {end}] is empty"
        k = lo = end  # invariant: start <= lo <= k and blocks [lo, k) are held
        while True:
            first = max(start, self.first_needed_block(k * self.block_size))
            while lo > first and held(lo - 1):
                lo -= 1
            if lo <= first:
                return k
            k = lo = lo - 1  # block lo - 1 is missing

    @classmethod
    def from_layer(cls, layer: Any, *, dtype: torch.dtype, block_size: int) -> KVSpec:
        """The spec of one model layer (`model_kv` reads it from the config); kinds take the fields they need."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVSpec):
    """A paged attention layer. A page is one block of this layer: K and V for `block_size` tokens."""

    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def describe(self) -> list:
        """What a peer must match for pages of this layer to mean the same (the connectors' compat hash)."""
        return [self.kind, self.num_kv_heads, self.head_size, dtype_name(self.dtype)]

    @classmethod
    def from_layer(cls, layer: LayerAttn, *, dtype: torch.dtype, block_size: int) -> KVSpec:
        return cls(num_kv_heads=layer.num_kv_heads, head_size=layer.head_size, dtype=dtype, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A token attends to every token before it: no block is ever skipped."""

    kind: ClassVar[str] = "full_attention"
    plan_order: ClassVar[int] = 0

    def resume_block(self, held: Callable[[int], bool], start: int, end: int) -> int:
        # Every block in [start, k) is read: the first missing block ends the hit, so scan left to right.
        assert 0 <= start <= end, f"resume range [{start}, {end}] is empty"
        k = start
        while k < end and held(k):
            k += 1
        return k

    def blocks_held(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to itself and the `sliding_window - 1` tokens before it."""

    kind: ClassVar[str] = "sliding_window"
    plan_order: ClassVar[int] = 1
    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def window_tokens(self) -> int | None:
        return self.sliding_window

    def blocks_held(self, num_tokens: int) -> int:
        # The window [n - W + 1, n] spans at most cdiv(W - 1, bs) + 1 blocks when it starts mid-block.
        return min(cdiv(num_tokens, self.block_size), cdiv(self.sliding_window - 1, self.block_size) + 1)

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        span = self.sliding_window - 1 + max_num_batched_tokens
        return min(cdiv(num_tokens, self.block_size), cdiv(span, self.block_size) + 1)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    # resume_block is KVSpec's right-to-left scan, which here is THE sliding-window hit rule: resuming at block k
    # reads tokens [k*bs - W + 1, k*bs), the `need = cdiv(W - 1, bs)` blocks before k (first_needed_block(k*bs)
    # is k - need once k >= need). So k is the end of the rightmost run of `need` held blocks in [start, end),
    # else start + the run of held blocks at `start` (shorter than `need`); need == 0 (W == 1) gives `end`.

    @classmethod
    def from_layer(cls, layer: LayerAttn, *, dtype: torch.dtype, block_size: int) -> KVSpec:
        return cls(
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=layer.sliding_window,  # the config reader checked it is set
        )
