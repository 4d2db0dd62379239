"""KV specs: what one attention layer needs from the KV cache, per block of tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

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
    """One layer's KV shape. A page is one block of this layer: K and V for `block_size` tokens."""

    kind: ClassVar[str] = "abstract"
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

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


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(KVSpec):
    kind: ClassVar[str] = "full_attention"

    def blocks_held(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(KVSpec):
    """A token attends to itself and the `sliding_window - 1` tokens before it."""

    kind: ClassVar[str] = "sliding_window"
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


SPEC_KINDS: dict[str, type[KVSpec]] = {cls.kind: cls for cls in (FullAttentionSpec, SlidingWindowSpec)}
