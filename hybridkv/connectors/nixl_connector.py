"""NixlConnector: prefill/decode disaggregation. The decode instance READs the prompt's KV from the prefill instance.

Producer (prefill) side: a request sent with kv_transfer_params {"do_remote_decode": true} keeps its blocks under a
lease when it finishes, and its response carries what a reader needs (engine id, side channel, block ids per group,
prompt length and hash). Consumer (decode) side: a request carrying those params handshakes with the peer once
(compatibility hash, NIXL metadata, where each owner layer lives), reads the blocks its own table needs (only
in-window blocks of sliding groups, nothing its local prefix cache already has), then releases the lease. Only if
the lease was still held at release is the read trusted; otherwise, or on any failure, the request recomputes
(kv_load_failure_policy=recompute, the default) or fails with the reason (fail).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from hybridkv.connectors.base import (
    ConnectorEvents,
    EngineIdentity,
    KVConnector,
    KVTransferConfig,
    finished_ok,
    register_connector,
)
from hybridkv.connectors.descriptors import Placement, block_moves, compat_hash, pair_descriptors
from hybridkv.connectors.leases import LeaseTable
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


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


@dataclass
class _Load:
    request_id: str
    engine_id: str
    remote_request_id: str
    moves: list[tuple[int, int, int]]
    state: str = "handshake"  # handshake -> ready -> reading -> releasing
    handle: Any = None
    started: float = 0.0
    aborted: bool = False


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
        self.loads: dict[str, _Load] = {}
        self.peers: dict[str, tuple[str, Placement]] = {}  # engine id -> (NIXL agent name, placement)
        self._event = threading.Event()
        self._wake = self._event.set
        self.stats = {"kv_transfer_reads": 0.0, "kv_transfer_bytes": 0.0, "kv_transfer_descriptors": 0.0}
        self.stats["kv_transfer_blocks"] = 0.0
        self.stats |= {"kv_transfer_seconds": 0.0, "kv_transfer_failures": 0.0}

    def register(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        self.plan = plan
        self.compat = compat_hash(plan, self.identity.model_fingerprint, self.identity.dtype)
        self.transport = NixlTransport(f"hybridkv-{self.identity.engine_id}", self.backends)
        self.transport.register(memory.buffers)
        self.placement = Placement.of(plan, [b.data_ptr() for b in memory.buffers])
        self.server = SideChannelServer(self.host, self.port, self._handle)
        self.port = self.server.port
        self.io = PeerIO(self._notify, self.lease_s / 3)
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

    # ---- consumer side -------------------------------------------------------------------------------------
    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0
        try:
            same = params["prompt_hash"] == prompt_hash(req.prompt_token_ids)
            same = same and int(params["remote_num_tokens"]) == req.num_prompt_tokens
            peer = (str(params["remote_engine_id"]), str(params["remote_host"]), int(params["remote_port"]))
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("request %s: malformed kv_transfer_params (%s): computing the prompt", req.request_id, e)
            req.kv_transfer_params = None
            return 0
        need = max(0, req.num_prompt_tokens - 1 - num_local_tokens)
        if not same or need == 0:
            if not same:
                logger.warning("request %s: prompt differs from the prefill's: computing it", req.request_id)
            self.io.release(peer[1], peer[2], str(params["remote_request_id"]))  # let the peer free now
            req.kv_transfer_params = None
            return 0
        return need

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        params = req.kv_transfer_params or {}
        engine_id, host, port = str(params["remote_engine_id"]), str(params["remote_host"]), int(params["remote_port"])
        load = _Load(req.request_id, engine_id, str(params["remote_request_id"]), [], started=time.monotonic())
        self.loads[req.request_id] = load
        self.io.track(req.request_id, host, port, load.remote_request_id)
        try:
            end = num_local_tokens + req.num_external_tokens
            load.moves = block_moves(block_ids, params["remote_block_ids"], num_local_tokens, end, self.plan.block_size)
        except (ValueError, TypeError, KeyError) as e:
            self._fail(load, f"bad remote_block_ids: {e}")
            return
        if engine_id in self.peers:
            load.state = "ready"
        else:
            self.io.handshake(
                engine_id, host, port, {"op": "handshake", "compat": self.compat, "engine_id": self.identity.engine_id}
            )

    def abort(self, request_id: str) -> bool:
        load = self.loads.get(request_id)
        if load is None:
            return True
        if load.state == "reading":
            load.aborted = True  # the read may still land in these blocks: free them when it is over
            return False
        self.loads.pop(request_id)
        if load.state != "releasing":
            self.io.release_tracked(request_id, False)
        return True

    def poll(self) -> ConnectorEvents:
        if len(self.leases):
            self.transport.progress()  # peers may be reading our blocks
        events = ConnectorEvents(released=self.leases.collect())
        for kind, key, value in self.io.results():
            if kind == "handshake":
                self._on_handshake(key, value, events)
            elif kind == "release" and key in self.loads:
                load = self.loads.pop(key)
                if value is True:
                    events.loaded[key] = True
                else:
                    events.loaded[key] = False
                    events.errors[key] = (
                        "the prefill instance's lease ended before the read finished" if value is False else str(value)
                    )
        for load in list(self.loads.values()):
            if load.state == "ready":
                self._start_read(load, events)
            elif load.state == "reading":
                self._check_read(load, events)
            elif load.state == "failed":
                self.loads.pop(load.request_id)
                events.loaded[load.request_id] = False
                events.errors[load.request_id] = load.handle
        return events

    def _on_handshake(self, engine_id: str, reply: Any, events: ConnectorEvents) -> None:
        error = None
        if isinstance(reply, dict) and reply.get("ok"):
            try:
                agent = self.transport.add_peer(base64.b64decode(reply["agent_metadata"]))
                self.peers[engine_id] = (agent, Placement.from_json(reply["placement"]))
                logger.info(
                    "handshake with %s done (its layout %s, ours %s)", engine_id, reply.get("layout"), self.plan.layout
                )
            except Exception as e:
                error = f"NIXL could not add peer {engine_id}: {e}"
        else:
            error = reply.get("error") if isinstance(reply, dict) else str(reply)
            logger.warning("handshake with %s failed: %s", engine_id, error)
        for load in self.loads.values():
            if load.engine_id == engine_id and load.state == "handshake":
                if error is None:
                    load.state = "ready"
                else:
                    self._fail(load, f"handshake with the prefill instance failed: {error}")

    def _start_read(self, load: _Load, events: ConnectorEvents) -> None:
        agent, remote = self.peers[load.engine_id]
        descs = pair_descriptors(
            self.plan, self.placement, remote, load.moves, self.transport.device_id, self.transport.device_id
        )
        if descs.count == 0:
            load.state = "releasing"
            self.io.release_tracked(load.request_id, True)
            return
        try:
            load.handle = self.transport.read(descs, agent)
        except Exception as e:
            self._fail(load, f"NIXL read failed to start: {e}")
            return
        load.state, load.started = "reading", time.monotonic()
        self.stats["kv_transfer_reads"] += 1
        self.stats["kv_transfer_bytes"] += descs.nbytes
        self.stats["kv_transfer_descriptors"] += descs.count
        self.stats["kv_transfer_blocks"] += len(load.moves)

    def _check_read(self, load: _Load, events: ConnectorEvents) -> None:
        state = self.transport.state(load.handle)
        if state == "PROC" and time.monotonic() - load.started < self.timeout_s:
            return
        if state == "PROC" and not self.transport.release(load.handle):
            return  # cannot cancel: keep the blocks until NIXL lets go
        if state != "PROC":
            self.transport.release(load.handle)
        self.stats["kv_transfer_seconds"] += time.monotonic() - load.started
        if load.aborted:
            self.loads.pop(load.request_id)
            events.released.append(load.request_id)
            self.io.release_tracked(load.request_id, False)
        elif state == "DONE":
            load.state = "releasing"
            self.io.release_tracked(load.request_id, True)
        else:
            self._fail(load, "the read from the prefill instance failed" if state == "ERR" else "the read timed out")

    def _fail(self, load: _Load, reason: str) -> None:
        self.stats["kv_transfer_failures"] += 1
        logger.warning("request %s: KV load failed: %s", load.request_id, reason)
        load.state, load.handle = "failed", reason
        self.io.release_tracked(load.request_id, False)

    # ---- engine loop ---------------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._wake()

    def set_waker(self, wake: Any) -> None:
        def both() -> None:
            self._event.set()
            wake()

        self._wake = both

    def has_pending(self) -> bool:
        return bool(self.loads) or len(self.leases) > 0

    def wait(self, timeout: float) -> None:
        if any(load.state == "reading" for load in self.loads.values()):
            timeout = min(timeout, POLL_READS_EVERY_S)
        elif len(self.leases):
            timeout = min(timeout, PROGRESS_EVERY_S)
        self._event.wait(timeout)
        self._event.clear()

    def next_deadline(self) -> float | None:
        deadline = self.leases.next_deadline()
        return None if deadline is None else min(deadline, PROGRESS_EVERY_S)

    def metrics(self) -> dict[str, float]:
        return self.stats | {
            "kv_leases_held": float(len(self.leases)),
            "kv_leases_expired_total": float(self.leases.expired_total),
            "kv_loads_in_flight": float(len(self.loads)),
        }

    def shutdown(self) -> None:
        self.server.close()
        self.io.stop()
