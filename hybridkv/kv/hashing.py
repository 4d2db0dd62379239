"""Chained block hashes for prefix caching, PD and offloading.

A block's hash covers its parent's hash, its token ids and extra keys (such as a cache salt), so equal hashes
mean equal prefixes. A `BlockHasher` makes them with one algorithm (`kv.hash_algos`: ours by default, or one of
vLLM's so that routers can recompute the ids KV events publish) from one root.

A BlockHash is BLOCK_HASH_BYTES long: the algorithm's digest, left-padded with zeros, whose bit 0 of byte 0 is
replaced by the private flag: set when the prefix is private (salted: the first block took a cache salt), inherited
down the chain, so every tier can tell a tenant's blocks from shared ones by the hash alone (KV events never
publish private ones). The next block chains from the digest itself (`Link`), so a vLLM algorithm's chain is
vLLM's bit for bit; ours chains from the BlockHash (its encoding, pinned since v1).

    BlockHash   [ byte 0: bit 0 = private | ... digest, left-padded ... | low 8 bytes: the published id ]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridkv.kv.hash_algos import HashAlgo, hash_algo

BlockHash = bytes
BLOCK_HASH_BYTES = 32
DEFAULT_HASH_ALGO = "hybridkv"


def is_private(block_hash: BlockHash) -> bool:
    """Whether the block belongs to a salted prefix."""
    return bool(block_hash[0] & 1)


class Link(NamedTuple):
    """One block of a chain: its id, and the digest the next block chains from."""

    block_hash: BlockHash
    digest: bytes


@dataclass(frozen=True)
class BlockHasher:
    """One algorithm and the root its chains start from. Build it once per engine (`from_environment`): with a
    vLLM algorithm and no PYTHONHASHSEED the root is random, and every request of the engine must share it."""

    algo: HashAlgo
    root: bytes

    @classmethod
    def create(cls, algo: str = DEFAULT_HASH_ALGO, hash_seed: str | None = None) -> BlockHasher:
        """`hash_seed`: vLLM's root seed, PYTHONHASHSEED's value (unused by our own algorithm)."""
        chosen = hash_algo(algo)
        return cls(chosen, chosen.root(hash_seed))

    @classmethod
    def from_environment(cls, algo: str = DEFAULT_HASH_ALGO) -> BlockHasher:
        return cls.create(algo, os.environ.get("PYTHONHASHSEED"))

    def link(
        self,
        parent: Link | None,
        token_ids: Sequence[int],
        extra: Sequence[str | int | bytes] = (),
        private: bool = False,
    ) -> Link:
        """`private`: mark the block as a salted prefix's (a child of a private parent is private whatever is
        given)."""
        digest = self.algo.block(self.root if parent is None else parent.digest, token_ids, tuple(extra) or None)
        out = bytearray(digest.rjust(BLOCK_HASH_BYTES, b"\0"))
        out[0] = (out[0] & 0xFE) | int(private or (parent is not None and is_private(parent.block_hash)))
        block_hash = bytes(out)
        return Link(block_hash, block_hash if self.algo.serialise is None else digest)

    def links(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        after: Link | None = None,
        cache_salt: str | None = None,
        start_block: int = 0,
    ) -> list[Link]:
        """The full blocks of `token_ids` from block `start_block` on, chained from `after` (block
        `start_block - 1`). The cache salt enters the first block only (as vLLM's extra keys do), so it
        separates whole prefixes."""
        out: list[Link] = []
        for b in range(start_block, len(token_ids) // block_size):
            extra = (cache_salt,) if (b == 0 and cache_salt) else ()
            after = self.link(after, token_ids[b * block_size : (b + 1) * block_size], extra, bool(cache_salt))
            out.append(after)
        return out

    def hash_blocks(
        self, token_ids: Sequence[int], block_size: int, *, cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The hashes of all full blocks of `token_ids`."""
        return [link.block_hash for link in self.links(token_ids, block_size, cache_salt=cache_salt)]


DEFAULT_HASHER = BlockHasher.create()
ROOT_HASH: BlockHash = DEFAULT_HASHER.root


# Our algorithm, chained from BlockHashes (its digests are its ids): for tests and tools; an engine uses its own
# hasher (`EngineConfig.prefix_caching_hash_algo`).
def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra: Sequence[str | int | bytes] = (), private: bool = False
) -> BlockHash:
    after = None if parent is None or parent == ROOT_HASH else Link(parent, parent)
    return DEFAULT_HASHER.link(after, token_ids, extra, private).block_hash


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: BlockHash | None = None,
    cache_salt: str | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    after = None if parent is None else Link(parent, parent)
    return [x.block_hash for x in DEFAULT_HASHER.links(token_ids, block_size, after=after, cache_salt=cache_salt,
                                                       start_block=start_block)]  # fmt: skip
