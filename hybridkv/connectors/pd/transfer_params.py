"""The kv_transfer_params of PD, typed (vLLM's field names): what a client sends a prefill instance, and what the
prefill instance hands back for a decoder.

    RemoteDecode {do_remote_decode: true}  -> a prefill instance: keep this request's blocks under a lease
    RemotePrefill (signed, one per prompt) -> back to the client, which passes it to a decoder
    RemoteBatch                            -> a completions batch's RemotePrefills, in prompt order

`params.py` parses them from a client (hostile input); the side channel's messages are in `protocol.py`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any

from hybridkv.connectors.mesh_auth import mac, mac_ok

EXPIRY_SLACK_S = 5  # clock difference tolerated between the prefill instance and the decoder


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


@dataclass(frozen=True)
class RemoteDecode:
    """To a prefill instance: keep this request's blocks under a lease for a decoder to read."""

    def to_json(self) -> dict[str, Any]:
        return {"do_remote_decode": True}


@dataclass(frozen=True)
class RemotePrefill:
    """To a decoder: read this prompt's KV from the prefill instance `engine_id` at `host:port`."""

    engine_id: str
    host: str
    port: int
    request_id: str  # the prefill instance's request id, for logs
    lease_id: str  # 128-bit random hex: a capability for this lease only
    block_ids: tuple[tuple[int, ...], ...]  # per group; 0 where no token reads (a sliding window let it go)
    num_tokens: int
    prompt_hash: str
    expires_at: int  # wall-clock seconds: the lease ends by then unless a reader renews it
    signature: str = ""
    # For a plan with a state group: the pages of each state entry the table holds (nonzero entries of
    # block_ids[state group], in entry order). On the wire as runs [first id, count] (`page_runs`).
    state_pages: tuple[tuple[int, ...], ...] = ()

    def signed_bytes(self) -> bytes:
        fields = [self.engine_id, self.host, self.port, self.request_id, self.lease_id,
                  [list(g) for g in self.block_ids], self.num_tokens, self.prompt_hash, self.expires_at]  # fmt: skip
        if self.state_pages:
            fields.append([page_runs(p) for p in self.state_pages])
        return json.dumps(fields, separators=(",", ":")).encode()

    def signed(self, params_key: bytes) -> RemotePrefill:
        sig = mac(params_key, b"remote prefill", self.signed_bytes()).hex()
        return replace(self, signature=sig)

    def signature_ok(self, params_key: bytes) -> bool:
        try:
            tag = bytes.fromhex(self.signature)
        except ValueError:
            return False
        return mac_ok(params_key, tag, b"remote prefill", self.signed_bytes())

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.expires_at + EXPIRY_SLACK_S

    def to_json(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_num_tokens": self.num_tokens,
            "prompt_hash": self.prompt_hash,
            "lease_id": self.lease_id,
            "expires_at": self.expires_at,
            "signature": self.signature,
        } | ({"remote_state_pages": [page_runs(p) for p in self.state_pages]} if self.state_pages else {})


def page_runs(pages: tuple[int, ...]) -> list[list[int]]:
    """Block ids as runs [first, count] of consecutive ids (a fresh pool hands out bundles as one run)."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return runs


@dataclass(frozen=True)
class RemoteBatch:
    """To a decoder, for a completions batch: each prompt's RemotePrefill in order (None: compute that prompt)."""

    items: tuple[RemotePrefill | None, ...]


def batch_json(items: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One kv_transfer_params object for a batch, as routers pass it on unread."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "batch": items}


TransferParams = RemoteDecode | RemotePrefill | RemoteBatch
PREFILL_KEYS = frozenset({"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
                          "remote_request_id", "remote_block_ids", "remote_num_tokens", "prompt_hash", "lease_id",
                          "expires_at", "signature", "remote_state_pages"})  # fmt: skip
