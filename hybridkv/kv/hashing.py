"""Chained block hashes for prefix caching, PD and offloading.

A block's hash covers its parent's hash, its token ids and extra keys (such as a cache salt), so equal hashes
mean equal prefixes. SHA-256 over a fixed byte encoding: identical across processes, machines and Python
versions, independent of PYTHONHASHSEED.

Bit 0 of a hash's first byte says whether its prefix is private (salted: the first block took a cache salt) and
is inherited down the chain, so every tier can tell a tenant's blocks from shared ones by the hash alone (KV
events never publish private ones). The other 255 bits are SHA-256's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"hybridkv/block-hash/v1").digest()


def _encode_extra(extra: Sequence[str | int | bytes]) -> bytes:
    out = bytearray()
    for item in extra:
        if isinstance(item, bytes):
            tag, raw = b"b", item
        elif isinstance(item, str):
            tag, raw = b"s", item.encode()
        elif isinstance(item, int):
            tag, raw = b"i", str(item).encode()
        else:
            raise TypeError(f"extra hash keys must be str, int or bytes, got {type(item).__name__}")
        out += tag + struct.pack("<I", len(raw)) + raw
    return bytes(out)


def is_private(block_hash: BlockHash) -> bool:
    """Whether the block belongs to a salted prefix."""
    return bool(block_hash[0] & 1)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra: Sequence[str | int | bytes] = (), private: bool = False
) -> BlockHash:
    """`private`: mark the hash as a salted prefix's (a child of a private parent is private whatever is given)."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra(extra))
    digest = bytearray(h.digest())
    inherited = parent is not None and parent != ROOT_HASH and is_private(parent)
    digest[0] = (digest[0] & 0xFE) | int(private or inherited)
    return bytes(digest)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: BlockHash | None = None,
    cache_salt: str | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from `parent` (the hash of
    block `start_block - 1`). The cache salt enters the first block only, so it separates whole prefixes."""
    hashes: list[BlockHash] = []
    for b in range(start_block, len(token_ids) // block_size):
        extra = (cache_salt,) if (b == 0 and cache_salt) else ()
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], extra, bool(cache_salt))
        hashes.append(parent)
    return hashes
