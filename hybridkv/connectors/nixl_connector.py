"""NixlConnector: prefill/decode disaggregation. The decode instance READs the prompt's KV from the prefill instance.

Producer (prefill) side: a request sent with kv_transfer_params {"do_remote_decode": true} keeps its blocks under a
lease when it finishes, and its response carries what a reader needs (engine id, side channel, block ids per group,
prompt length and hash). Consumer (decode) side, in `NixlReader`: a request carrying those params handshakes with
the peer once (compatibility hash, NIXL metadata, where each owner layer lives), reads the blocks its table needs (only
in-window blocks of sliding groups, nothing its local prefix cache already has), then releases the lease. Only if
the lease was still held at release is the read trusted; otherwise, or on any failure, the request recomputes
(kv_load_failure_policy=recompute, the default) or fails with the reason (fail).
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Any

from hybridkv.connectors.base import (
    ConnectorEvents,
    EngineIdentity,
    KVConnector,
    KVTransferConfig,
    finished_ok,
    register_connector,
)
from hybridkv.connectors.descriptors import Placement, compat_hash
from hybridkv.connectors.leases import LeaseTable
from hybridkv.connectors.nixl_reader import NixlReader, prompt_hash
from hybridkv.connectors.nixl_transport import NixlTransport
from hybridkv.connectors.peer_io import PeerIO
from hybridkv.connectors.side_channel import SideChannelServer
from hybridkv.engine.request import Request
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan

logger = logging.getLogger(__name__)

OPTIONS = {
    "side_channel_host",
    "side_channel_port",
    "kv_lease_s",
    "kv_load_failure_policy",
    "kv_transfer_timeout_s",
    "enable_cross_layers_blocks",
    "backends",
}
POLICIES = ("recompute", "fail")
PROGRESS_EVERY_S = 0.0005  # how often a prefill instance drives UCX while it holds leases (a peer may read)
POLL_READS_EVERY_S = 0.00005  # how often a reader polls its reads in flight (they last ~0.1-10 ms)


@register_connector("NixlConnector")
class NixlConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, identity: EngineIdentity) -> None:
        unknown = set(config.kv_connector_extra_config) - OPTIONS
        if unknown:
            known = ", ".join(sorted(OPTIONS))
            raise ValueError(f"kv_connector_extra_config has unknown keys {sorted(unknown)}; known: {known}")
        self.identity = identity
        self.host = config.option("side_channel_host", "127.0.0.1", str)
        self.port = config.option("side_channel_port", 5600, int)
        self.lease_s = config.option("kv_lease_s", 30.0, float)
        self.timeout_s = config.option("kv_transfer_timeout_s", 30.0, float)
        self.load_failure_policy = config.option("kv_load_failure_policy", "recompute", str)
        self.backends = config.option("backends", ["UCX"], list)
        if self.load_failure_policy not in POLICIES:
            raise ValueError(f"kv_connector_extra_config.kv_load_failure_policy must be one of {POLICIES}")
        if self.lease_s <= 0 or self.timeout_s <= 0:
            raise ValueError("kv_connector_extra_config.kv_lease_s and kv_transfer_timeout_s must be positive")
        self.leases = LeaseTable(self.lease_s)
        self._event = threading.Event()
        self._wake = self._event.set

    def register(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        self.plan = plan
        self.compat = compat_hash(plan, self.identity.model_fingerprint, self.identity.dtype)
        self.transport = NixlTransport(f"hybridkv-{self.identity.engine_id}", self.backends)
        self.transport.register(memory.buffers)
        self.placement = Placement.of(plan, [b.data_ptr() for b in memory.buffers])
        self.server = SideChannelServer(self.host, self.port, self._handle)
        self.port = self.server.port
        io = PeerIO(lambda: self._wake(), self.lease_s / 3)  # through the attribute: set_waker replaces it
        handshake = {"op": "handshake", "compat": self.compat, "engine_id": self.identity.engine_id}
        self.reader = NixlReader(plan, self.transport, self.placement, handshake, io, self.timeout_s)
        logger.info(
            "NixlConnector %s: side channel %s:%d, layout %s",
            self.identity.engine_id,
            self.host,
            self.port,
            plan.layout,
        )

    # ---- producer side -------------------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_decode") or not finished_ok(req):
            return False, None
        self.leases.grant(req.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.identity.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": block_ids,
            "remote_num_tokens": req.num_prompt_tokens,
            "prompt_hash": prompt_hash(req.prompt_token_ids),
            "lease_s": self.lease_s,
        }

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Side-channel requests from readers (on the listener thread)."""
        op = msg.get("op")
        if op == "handshake":
            if msg.get("compat") != self.compat:
                reason = (
                    f"incompatible KV: peer {msg.get('engine_id')} has compat hash {msg.get('compat')}, "
                    f"this instance {self.compat} (model, dtype, block size or KV groups differ)"
                )
                logger.warning("refused a handshake: %s", reason)
                return {"ok": False, "error": reason}
            return {
                "ok": True,
                "engine_id": self.identity.engine_id,
                "compat": self.compat,
                "agent_metadata": base64.b64encode(self.transport.metadata()).decode(),
                "placement": self.placement.to_json(),
                "layout": self.plan.layout,
            }
        if op in ("renew", "release"):
            rid = str(msg.get("request_id"))
            ok = self.leases.renew(rid) if op == "renew" else self.leases.release(rid)
            if op == "release":
                self._wake()
            return {"ok": ok}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ---- consumer side: NixlReader -------------------------------------------------------------------------
    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        return self.reader.num_external_tokens(req, num_local_tokens)

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        self.reader.start_load(req, block_ids, num_local_tokens)

    def abort(self, request_id: str) -> bool:
        return self.reader.abort(request_id)

    def poll(self) -> ConnectorEvents:
        if len(self.leases):
            self.transport.progress()  # peers may be reading our blocks
        events = ConnectorEvents(released=self.leases.collect())
        self.reader.poll(events)
        return events

    # ---- engine loop ---------------------------------------------------------------------------------------
    def set_waker(self, wake: Any) -> None:
        def both() -> None:
            self._event.set()
            wake()

        self._wake = both

    def has_pending(self) -> bool:
        return bool(self.reader.loads) or len(self.leases) > 0

    def wait(self, timeout: float) -> None:
        if self.reader.reading:
            timeout = min(timeout, POLL_READS_EVERY_S)
        elif len(self.leases):
            timeout = min(timeout, PROGRESS_EVERY_S)
        self._event.wait(timeout)
        self._event.clear()

    def next_deadline(self) -> float | None:
        deadline = self.leases.next_deadline()
        return None if deadline is None else min(deadline, PROGRESS_EVERY_S)

    def metrics(self) -> dict[str, float]:
        return self.reader.stats | {
            "kv_leases_held": float(len(self.leases)),
            "kv_leases_expired_total": float(self.leases.expired_total),
            "kv_loads_in_flight": float(len(self.reader.loads)),
        }

    def shutdown(self) -> None:
        self.server.close()
        self.reader.io.stop()
