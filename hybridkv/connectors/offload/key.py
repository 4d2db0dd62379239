"""Key: what names one offloaded entry in every tier, the KV of one block of one group."""

from __future__ import annotations

from hybridkv.kv.hashing import BlockHash

Key = tuple[BlockHash, int]  # (block hash of the prefix up to and including the block, group id)


def describe(key: Key) -> str:
    """A short name for logs and errors: the hash's first 12 hex digits and the group."""
    return f"block {key[0].hex()[:12]} of group {key[1]}"
