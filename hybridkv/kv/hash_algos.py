"""Prefix-caching hash algorithms, by name: ours and vLLM's (`--prefix-caching-hash-algo`).

Every algorithm maps (parent digest, a block's token ids, extra keys) to the block's digest. vLLM's serialise the
triple `(parent, tuple(token_ids), extra_keys or None)` and digest the bytes:

    name          serialiser                     digest        bytes
    sha256        pickle, highest protocol       SHA-256       32
    sha256_cbor   CBOR, canonical                SHA-256       32
    xxhash        pickle, highest protocol       XXH3-128      16
    xxhash_cbor   CBOR, canonical                XXH3-128      16
    hybridkv      our fixed byte encoding        SHA-256       32   (the default)

The root (the parent of a chain's first block) follows vLLM's rule for vLLM's algorithms: the algorithm applied
to the string PYTHONHASHSEED when it is set, 32 random bytes per process when it is not (so a router recomputing
vLLM's ids needs PYTHONHASHSEED set on both sides). Ours has a fixed root: equal in every process whatever the
environment, which the disk tier and peers rely on.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

ExtraKeys = tuple[Any, ...] | None  # vLLM's extra keys: None when a block has none


def _encode_extra(extra: ExtraKeys) -> bytes:
    out = bytearray()
    for item in extra or ():
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


def _native(parent: bytes, token_ids: Sequence[int], extra: ExtraKeys) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra(extra))
    return h.digest()


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class HashAlgo:
    """One algorithm. `digest_size`: bytes of its digests (shorter ones are left-padded with zeros to
    BLOCK_HASH_BYTES in a BlockHash, so the low 8 bytes that KV events publish are the digest's own)."""

    name: str
    digest_size: int
    serialise: Callable[[Any], bytes] | None  # None: our own encoding (`_native`)
    digest: Callable[[bytes], bytes]

    def block(self, parent: bytes, token_ids: Sequence[int], extra: ExtraKeys) -> bytes:
        if self.serialise is None:
            return _native(parent, token_ids, extra)
        return self.digest(self.serialise((parent, tuple(int(t) for t in token_ids), extra)))

    def root(self, hash_seed: str | None) -> bytes:
        """The parent of a chain's first block (see the module docstring for the rule)."""
        if self.serialise is None:
            return hashlib.sha256(b"hybridkv/block-hash/v1").digest()
        if hash_seed is None:
            return os.urandom(32)
        return self.digest(self.serialise(hash_seed))


HASH_ALGOS: dict[str, HashAlgo] = {
    algo.name: algo
    for algo in (
        HashAlgo("hybridkv", 32, None, _sha256),
        HashAlgo("sha256", 32, _pickled, _sha256),
        HashAlgo("sha256_cbor", 32, _cbor, _sha256),
        HashAlgo("xxhash", 16, _pickled, xxhash.xxh3_128_digest),
        HashAlgo("xxhash_cbor", 16, _cbor, xxhash.xxh3_128_digest),
    )
}


def hash_algo(name: str) -> HashAlgo:
    """The algorithm called `name`; a ValueError naming the choices otherwise."""
    try:
        return HASH_ALGOS[name]
    except KeyError:
        raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {name!r}") from None
