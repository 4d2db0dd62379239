"""NixlReader: the decode side of NixlConnector. For each request that carries a prefill instance's
kv_transfer_params it handshakes once per peer, READs the blocks its own table needs, then releases the lease.

Load states: handshake -> confirming -> ready -> reading -> releasing, or failed. A read starts only after the peer
confirms the lease is held (an expired one fails fast and the request recomputes, instead of a read that waits for
its timeout); a load is reported `loaded` only once the peer confirms the lease was still held at release, and
blocks a read may still write are never handed back early.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hybridkv.connectors.base import ConnectorEvents
from hybridkv.connectors.descriptors import Placement, block_moves, pair_descriptors
from hybridkv.connectors.nixl_transport import NixlTransport
from hybridkv.connectors.peer_io import PeerIO
from hybridkv.engine.request import Request
from hybridkv.kv.plan import KVPlan

logger = logging.getLogger(__name__)


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


@dataclass
class _Load:
    request_id: str
    engine_id: str
    remote_request_id: str
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (group, local block, remote block)
    state: str = "handshake"
    handle: Any = None  # the NIXL transfer while reading
    started: float = 0.0
    aborted: bool = False
    error: str | None = None


class NixlReader:
    def __init__(
        self,
        plan: KVPlan,
        transport: NixlTransport,
        placement: Placement,
        handshake: dict[str, Any],
        io: PeerIO,
        timeout_s: float,
    ) -> None:
        self.plan, self.transport, self.placement, self.io = plan, transport, placement, io
        self.handshake = handshake  # what we send a peer: our compat hash and engine id
        self.timeout_s = timeout_s
        self.loads: dict[str, _Load] = {}
        self.peers: dict[str, tuple[str, Placement]] = {}  # engine id -> (NIXL agent name, placement)
        self.stats = {
            "kv_transfer_reads": 0.0,
            "kv_transfer_bytes": 0.0,
            "kv_transfer_descriptors": 0.0,
            "kv_transfer_blocks": 0.0,
            "kv_transfer_seconds": 0.0,
            "kv_transfer_failures": 0.0,
        }

    @property
    def reading(self) -> bool:
        return any(load.state == "reading" for load in self.loads.values())

    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0
        try:
            same = params["prompt_hash"] == prompt_hash(req.prompt_token_ids)
            same = same and int(params["remote_num_tokens"]) == req.num_prompt_tokens
            host, port, remote_id = str(params["remote_host"]), int(params["remote_port"]), params["remote_request_id"]
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("request %s: malformed kv_transfer_params (%s): computing the prompt", req.request_id, e)
            req.kv_transfer_params = None
            return 0
        need = max(0, req.num_prompt_tokens - 1 - num_local_tokens)
        if not same or need == 0:
            if not same:
                logger.warning("request %s: prompt differs from the prefill's: computing it", req.request_id)
            self.io.release(host, port, str(remote_id))  # nothing to read: the peer may free now
            req.kv_transfer_params = None
            return 0
        return need

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        params = req.kv_transfer_params or {}
        engine_id, host, port = str(params["remote_engine_id"]), str(params["remote_host"]), int(params["remote_port"])
        load = _Load(req.request_id, engine_id, str(params["remote_request_id"]), started=time.monotonic())
        self.loads[req.request_id] = load
        self.io.track(req.request_id, host, port, load.remote_request_id)
        try:
            end = num_local_tokens + req.num_external_tokens
            load.moves = block_moves(block_ids, params["remote_block_ids"], num_local_tokens, end, self.plan.block_size)
        except (ValueError, TypeError, KeyError) as e:
            self._fail(load, f"bad remote_block_ids: {e}")
            return
        if engine_id in self.peers:
            self._confirm(load)
        else:
            self.io.handshake(engine_id, host, port, self.handshake)

    def _confirm(self, load: _Load) -> None:
        load.state = "confirming"
        self.io.confirm(load.request_id)

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

    def poll(self, events: ConnectorEvents) -> None:
        for kind, key, value in self.io.results():
            if kind == "handshake":
                self._on_handshake(key, value)
            elif kind == "lease" and key in self.loads and self.loads[key].state == "confirming":
                if value is True:
                    self.loads[key].state = "ready"
                else:
                    lost = "the prefill instance's lease had ended before the read" if value is False else str(value)
                    self._fail(self.loads[key], lost)
            elif kind == "release" and key in self.loads:
                del self.loads[key]
                events.loaded[key] = value is True
                if value is not True:
                    lost = "the prefill instance's lease ended before the read finished"
                    events.errors[key] = lost if value is False else str(value)
                    self.stats["kv_transfer_failures"] += 1
                    logger.warning("request %s: KV load discarded: %s", key, events.errors[key])
        for load in list(self.loads.values()):
            if load.state == "ready":
                self._start_read(load)
            elif load.state == "reading":
                self._check_read(load, events)
            if load.state == "failed":
                del self.loads[load.request_id]
                events.loaded[load.request_id] = False
                events.errors[load.request_id] = load.error or "KV load failed"

    def _on_handshake(self, engine_id: str, reply: Any) -> None:
        error = None
        if isinstance(reply, dict) and reply.get("ok"):
            try:
                agent = self.transport.add_peer(base64.b64decode(reply["agent_metadata"]))
                self.peers[engine_id] = (agent, Placement.from_json(reply["placement"]))
                logger.info("handshake with %s done (its layout %s, ours %s)", engine_id, reply.get("layout"),
                            self.plan.layout)  # fmt: skip
            except Exception as e:
                error = f"NIXL could not add peer {engine_id}: {e}"
        else:
            error = reply.get("error") if isinstance(reply, dict) else str(reply)
            logger.warning("handshake with %s failed: %s", engine_id, error)
        for load in self.loads.values():
            if load.engine_id == engine_id and load.state == "handshake":
                if error is None:
                    self._confirm(load)
                else:
                    self._fail(load, f"handshake with the prefill instance failed: {error}")

    def _start_read(self, load: _Load) -> None:
        agent, remote = self.peers[load.engine_id]
        device = self.transport.device_id
        descs = pair_descriptors(self.plan, self.placement, remote, load.moves, device, device)
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
            del self.loads[load.request_id]
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
        load.state, load.error = "failed", reason
        self.io.release_tracked(load.request_id, False)
