"""vLLM's KV-event wire format: the msgpack payload of one batch.

A batch is a 3-element array `[ts, events, data_parallel_rank]` (vLLM's `KVEventBatch`, an array-like msgspec
struct). Each event is a map tagged with its type under "type": recent vLLM encodes event structs by field name
(vLLM PR #42892; v0.26 sends this shape), and consumers (llm-d, Dynamo) select fields by name:

    {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64 | nil, "token_ids": [int...],
     "block_size": int, "lora_id": nil, "medium": "GPU" | "CPU" | "STORAGE", "lora_name": nil,
     "group_idx": int, "kv_cache_spec_kind": "full_attention" | "sliding_window" | "mamba",
     "kv_cache_spec_sliding_window": int (sliding-window groups only)}
    {"type": "BlockRemoved", "block_hashes": [u64...], "medium": str, "group_idx": int}
    {"type": "AllBlocksCleared"}

Fields vLLM declares without a default are always present (nil when unknown); fields with a default (extra_keys,
group_idx, the spec fields) are left out when they hold it, as msgspec's `omit_defaults` does.

Block hashes go out as vLLM's default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the low 64 bits of the hash read
big-endian, an unsigned int. Our hashes are SHA-256 over our own encoding (`kv.hashing`), so a consumer must use
them as opaque ids (as Dynamo and llm-d do with the engine's hashes) and recompute its own from `token_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from hybridkv.kv.events import BlockRemoved, BlockStored, KVEvent
from hybridkv.kv.hashing import BlockHash

# Our cache kinds as vLLM names its KV cache spec kinds (a recurrent state is vLLM's MambaSpec, GDN included).
SPEC_KINDS = {"full_attention": "full_attention", "sliding_window": "sliding_window", "recurrent_state": "mamba"}


def external_hash(block_hash: BlockHash) -> int:
    """The hash as vLLM publishes it: its last 8 bytes as a big-endian unsigned integer."""
    return int.from_bytes(block_hash[-8:], "big")


def event_to_wire(event: KVEvent, groups: Mapping[int, tuple[str, int | None]]) -> dict[str, Any]:
    """One record as its wire map. `groups`: group id -> (our kind name, sliding window or None)."""
    if isinstance(event, BlockStored):
        kind, window = groups.get(event.group_id, ("", None))
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "parent_block_hash": None if event.parent_block_hash is None else external_hash(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            "group_idx": event.group_id,
        }
        if kind in SPEC_KINDS:
            out["kv_cache_spec_kind"] = SPEC_KINDS[kind]
        if window is not None:
            out["kv_cache_spec_sliding_window"] = window
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": event.group_id,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: Sequence[KVEvent], groups: Mapping[int, tuple[str, int | None]], data_parallel_rank: int = 0
) -> bytes:
    """The msgpack payload of one batch (the third frame of a PUB message)."""
    return msgpack.packb([float(ts), [event_to_wire(e, groups) for e in events], data_parallel_rank])
