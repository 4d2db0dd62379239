"""The PD side channel, typed: what a decoder asks a prefill instance and what it answers, and a load's states
(the kv_transfer_params that lead a decoder there are in `transfer_params.py`).

    HandshakeRequest {op: handshake, compat, engine_id}  -> HandshakeReply | Refusal
    LeaseRequest     {op: renew | release, lease_id, signature} -> LeaseReply | Refusal

Every parse treats its input as hostile (a peer's bytes, even after their MAC verified): types, lengths and
ranges are checked and anything else is a `ValueError`.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hybridkv.connectors.pd.descriptors import Placement

MAX_METADATA = 1 << 18  # bytes of NIXL agent metadata (a few hundred bytes per registered buffer)
MAX_LAYERS = 4096
MAX_NUM_BLOCKS = 1 << 31
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_LAYOUT = re.compile(r"[a-z_-]{1,32}")


class LoadState(Enum):
    """A decoder's load of one request: handshake with the peer, confirm (renew) the lease, read, release."""

    HANDSHAKE = "handshake"
    CONFIRMING = "confirming"
    READY = "ready"
    READING = "reading"
    RELEASING = "releasing"
    FAILED = "failed"


class Op(str, Enum):
    HANDSHAKE = "handshake"
    RENEW = "renew"
    RELEASE = "release"


@dataclass(frozen=True)
class HandshakeRequest:
    compat: str  # the sender's compatibility hash: the two must be equal
    engine_id: str

    def to_json(self) -> dict[str, Any]:
        return {"op": Op.HANDSHAKE.value, "compat": self.compat, "engine_id": self.engine_id}


@dataclass(frozen=True)
class LeaseRequest:
    op: Op  # RENEW or RELEASE
    lease_id: str
    signature: str  # of the kv_transfer_params the lease was issued with: binds the lease to its blocks

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op.value, "lease_id": self.lease_id, "signature": self.signature}


@dataclass(frozen=True)
class HandshakeReply:
    engine_id: str
    agent_metadata: bytes
    placement: Placement
    num_blocks: int  # the pool's size: remote block ids must be below it
    layout: str

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
            "placement": self.placement.to_json(),
            "state_regions": [list(r) for r in self.placement.regions],
            "num_blocks": self.num_blocks,
            "layout": self.layout,
        }


@dataclass(frozen=True)
class LeaseReply:
    held: bool  # the lease was held (renew: and is extended; release: the read may be trusted)

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "held": self.held}


@dataclass(frozen=True)
class Refusal:
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error}


def parse_request(msg: Mapping[str, Any]) -> HandshakeRequest | LeaseRequest:
    op = msg.get("op")
    if op == Op.HANDSHAKE.value:
        _keys(msg, {"op", "compat", "engine_id"})
        return HandshakeRequest(_match(msg, "compat", _HEX64), _match(msg, "engine_id", _ID))
    if op in (Op.RENEW.value, Op.RELEASE.value):
        _keys(msg, {"op", "lease_id", "signature"})
        return LeaseRequest(Op(op), _match(msg, "lease_id", _HEX32), _match(msg, "signature", _HEX64))
    raise ValueError("unknown op")


def parse_handshake_reply(msg: Mapping[str, Any]) -> HandshakeReply | Refusal:
    if msg.get("ok") is not True:
        return _refusal(msg)
    fields = {"ok", "engine_id", "agent_metadata", "placement", "num_blocks", "layout"}
    _keys(msg, fields | ({"state_regions"} if "state_regions" in msg else set()))
    meta = msg.get("agent_metadata")
    if not isinstance(meta, str) or len(meta) > MAX_METADATA * 4 // 3 + 4:
        raise ValueError("agent_metadata: malformed")
    try:
        metadata = base64.b64decode(meta, validate=True)
    except binascii.Error as e:
        raise ValueError("agent_metadata: not base64") from e
    num_blocks = msg.get("num_blocks")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
        raise ValueError("num_blocks: malformed")
    engine_id, layout = _match(msg, "engine_id", _ID), _match(msg, "layout", _LAYOUT)
    placement = _placement(msg.get("placement"), msg.get("state_regions", []))
    return HandshakeReply(engine_id, metadata, placement, num_blocks, layout)


def parse_lease_reply(msg: Mapping[str, Any]) -> LeaseReply | Refusal:
    if msg.get("ok") is not True:
        return _refusal(msg)
    _keys(msg, {"ok", "held"})
    if not isinstance(msg.get("held"), bool):
        raise ValueError("held: malformed")
    return LeaseReply(msg["held"])


MAX_PEER_TEXT = 200  # characters of a peer's refusal text we keep


def peer_text(value: str) -> str:
    """Text a peer sent, made safe to log and to quote in errors: at most MAX_PEER_TEXT characters, escaped as
    `ascii()` does (no newline, control or escape sequence survives to forge a log line or move a terminal)."""
    escaped = ascii(value[: MAX_PEER_TEXT + 1])[1:-1]  # printable ASCII only: cutting it anywhere is safe
    return escaped if len(escaped) <= MAX_PEER_TEXT else escaped[:MAX_PEER_TEXT] + "..."


def _refusal(msg: Mapping[str, Any]) -> Refusal:
    """Invariant: a Refusal's error from a peer is always `peer_text`, whatever logs or quotes it later."""
    error = msg.get("error")
    return Refusal(peer_text(error) if isinstance(error, str) else "refused")


def _keys(msg: Mapping[str, Any], allowed: set[str]) -> None:
    if set(msg) != allowed:
        raise ValueError(f"fields must be exactly {', '.join(sorted(allowed))}")


def _match(msg: Mapping[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{key}: malformed")
    return value


def _placement(value: Any, regions: Any) -> Placement:
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_LAYERS:
        raise ValueError("placement: malformed")
    layers = {}
    for layer, pair in value.items():
        ok = isinstance(layer, str) and layer.isdigit() and len(layer) <= 6
        ok = (
            ok
            and isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in pair)
        )
        if not ok:
            raise ValueError("placement: malformed")
        layers[int(layer)] = (pair[0], pair[1])
    if not isinstance(regions, list) or len(regions) > MAX_LAYERS:
        raise ValueError("state_regions: malformed")
    for r in regions:
        if not (isinstance(r, list) and len(r) == 4 and all(_u64(v) for v in r)):
            raise ValueError("state_regions: malformed")
    return Placement(layers, tuple(tuple(r) for r in regions))


def _u64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64
