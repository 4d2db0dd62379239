"""What the config readers return per layer, before block size and dtype are chosen, and the attention fields
every reader shares. `LayerState` (a recurrent layer) lives in `state.py`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerAttn:
    """Attention shape of one layer, before block size and dtype are chosen."""

    kind: str  # a name in `kinds.CACHE_KINDS`: "full_attention" | "sliding_window"
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (from the model config), got {value!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


def head_dim(cfg: Mapping[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_heads(cfg: Mapping[str, Any]) -> int:
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
