"""The recurrent-state cache kind: Gated DeltaNet and Mamba2 layers keep one fixed-size state per request.

Table semantics (a block-table kind like attention). A request's table has one entry per block of tokens; entry e
holds the state after the tokens computed so far in block e's range, so the live state after c computed tokens
is entry cdiv(c, bs) - 1. An entry the request has moved past holds the state after exactly (e + 1) * bs tokens
(a checkpoint, published under block hash e like any full block) or is the null block: a prefill chunk that
crosses several blocks writes only the entry where it ends, and the entries it jumps over stay null. Hence:
- num_skipped_tokens(c) = c - 1: first_needed_block(c) is the entry of the live state;
- resuming at block k needs entry k - 1 only (KVSpec's right-to-left `resume_block` gives exactly that);
- a request holds 1 entry (one bundle) while it decodes, 2 during a step that crosses a block (the old
  live entry, read, and the new one, written; the old one goes at the next `remove_skipped_blocks`).
The state kind's manager is `state_manager.StateManager`. How the state bytes map to block ids: `state_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridkv.kv.spec import KVSpec, cdiv, dtype_name, resolve_dtype

STATE_ALIGN = 64  # bytes: every part of a state blob (a layer's conv or recurrent state) starts at a multiple
MIXERS = ("gated_deltanet", "mamba2")


def align_up(n: int, to: int = STATE_ALIGN) -> int:
    return cdiv(n, to) * to


STATE_DTYPES = ("float32", "bfloat16", "int8")  # a recurrent state's storage (int8: rows with float32 scales)


def resolve_state_dtype(name: str) -> torch.dtype:
    """A recurrent state's storage dtype by name: a KV dtype, or int8 (quantized rows)."""
    return torch.int8 if name == "int8" else resolve_dtype(name)


@dataclass(frozen=True)
class LayerState:
    """Recurrent-state shape of one layer, before block size and the KV dtype are chosen (the config reader's
    output, as `LayerAttn` is for attention). Dtypes are config names; None means "the KV dtype"."""

    mixer: str  # "gated_deltanet" | "mamba2"
    conv_kernel: int  # K: the conv keeps the last K - 1 inputs
    conv_dim: int
    ssm_shape: tuple[int, ...]  # GDN (Hv, dk, dv); Mamba2 (H, P, N)
    chunk_size: int  # the scan's chunk C
    conv_dtype: str | None = None
    ssm_dtype: str | None = None
    kind: str = "recurrent_state"

    def __post_init__(self) -> None:
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {', '.join(MIXERS)}, got {self.mixer!r}")
        for name in ("conv_kernel", "conv_dim", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer (from the model config), got {value!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"the conv kernel must be at least 2 wide (it keeps K - 1 inputs), got {self.conv_kernel}")
        if not self.ssm_shape or any(not isinstance(d, int) or d < 1 for d in self.ssm_shape):
            raise ValueError(f"the recurrent state shape must be positive integers, got {self.ssm_shape!r}")


@dataclass(frozen=True, kw_only=True)
class RecurrentStateSpec(KVSpec):
    """One recurrent layer's state: conv [K - 1, conv_dim] (token-major, `dtype`) and recurrent `ssm_shape`
    (`ssm_dtype`). Its "page" is the whole state (`state_bytes`); the planner cuts the states of all recurrent
    layers into block-sized pages (`state_plan.StateLayout`)."""

    kind: ClassVar[str] = "recurrent_state"
    plan_order: ClassVar[int] = 2
    interior_nulls: ClassVar[bool] = True
    per_request_state: ClassVar[bool] = True
    mixer: str
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...]
    ssm_dtype: torch.dtype
    chunk_size: int

    def describe(self) -> list:
        """What a peer must match for this layer's state bytes to mean the same: the scan's chunk and the state
        dtypes too (a state computed with another chunk grid is not the same bits)."""
        return [
            self.kind,
            self.mixer,
            list(self.conv_shape),
            list(self.ssm_shape),
            dtype_name(self.dtype),
            dtype_name(self.ssm_dtype),
            self.chunk_size,
        ]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {', '.join(MIXERS)}, got {self.mixer!r}")
        if len(self.conv_shape) != 2 or any(d < 1 for d in self.conv_shape):
            raise ValueError(f"conv_shape must be (K - 1, conv_dim), both positive, got {self.conv_shape}")
        if not self.ssm_shape or any(d < 1 for d in self.ssm_shape):
            raise ValueError(f"ssm_shape must be positive, got {self.ssm_shape}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    @property
    def conv_bytes(self) -> int:
        return math.prod(self.conv_shape) * self.dtype.itemsize

    @property
    def ssm_quantized(self) -> bool:
        """int8 storage: each row (the last dim) as int8 with one float32 scale (`models/state_store.Int8Rows`)."""
        return self.ssm_dtype == torch.int8

    @property
    def ssm_scale_offset(self) -> int:
        """Where an int8 state's float32 row scales begin, in bytes from its recurrent region's start."""
        return align_up(math.prod(self.ssm_shape))

    @property
    def ssm_bytes(self) -> int:
        if self.ssm_quantized:  # |int8 values|pad|float32 scale per row|
            return self.ssm_scale_offset + math.prod(self.ssm_shape[:-1]) * 4
        return math.prod(self.ssm_shape) * self.ssm_dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of this layer in a state blob: conv, then recurrent state, each starting 64-byte aligned."""
        return align_up(self.conv_bytes) + align_up(self.ssm_bytes)

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes

    def blocks_held(self, num_tokens: int) -> int:
        return min(1, cdiv(num_tokens, self.block_size))

    def blocks_admitted(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        return min(2, cdiv(num_tokens, self.block_size))

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    @classmethod
    def from_layer(cls, layer: LayerState, *, dtype: torch.dtype, block_size: int) -> KVSpec:
        conv = resolve_dtype(layer.conv_dtype) if layer.conv_dtype else dtype
        ssm = resolve_state_dtype(layer.ssm_dtype) if layer.ssm_dtype else conv
        return cls(
            dtype=conv,
            block_size=block_size,
            mixer=layer.mixer,
            conv_shape=(layer.conv_kernel - 1, layer.conv_dim),
            ssm_shape=tuple(layer.ssm_shape),
            ssm_dtype=ssm,
            chunk_size=layer.chunk_size,
        )
