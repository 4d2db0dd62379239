"""NixlReader: the decode side of NixlConnector. For each request that carries a prefill instance's verified
`RemotePrefill` it handshakes once per peer, READs the blocks its own table needs, then releases the lease.

Load states: handshake -> confirming -> ready -> reading -> releasing, or failed. A read starts only after the peer
confirms the lease is held (an expired one fails fast and the request recomputes, instead of a read that waits for
its timeout); a load is reported `loaded` only once the peer confirms the lease was still held at release, and
blocks a read may still write are never handed back early. A peer is known by the engine id it proved at its
handshake, at the address it answered on: params that place a known engine elsewhere, or name blocks outside its
pool, fail without contacting anyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.connectors.base import ConnectorEvents
from hybridkv.connectors.pd import read_stats
from hybridkv.connectors.pd.descriptors import Placement, block_moves, pair_descriptors
from hybridkv.connectors.pd.peer_io import PeerIO, PeerResult, ResultKind, Target
from hybridkv.connectors.pd.protocol import HandshakeRequest, LoadState
from hybridkv.connectors.pd.transfer_params import RemotePrefill, prompt_hash
from hybridkv.connectors.pd.transport import NixlTransport
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.prefix import reusable_tokens
from hybridkv.request.state import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    host: str
    port: int
    agent: str  # NIXL's name for the remote agent
    placement: Placement
    num_blocks: int


@dataclass
class _Load:
    request_id: str
    params: RemotePrefill
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (group, local block, remote block)
    state: LoadState = LoadState.HANDSHAKE
    handle: Any = None  # the NIXL transfer while reading
    started: float = 0.0
    aborted: bool = False
    error: str | None = None


def lease_target(params: RemotePrefill) -> Target:
    return Target(params.host, params.port, params.lease_id, params.signature)


class NixlReader:
    def __init__(
        self,
        plan: KVPlan,
        transport: NixlTransport,
        placement: Placement,
        handshake: HandshakeRequest,
        io: PeerIO,
        timeout_s: float,
        pages: Callable[[int], tuple[int, ...]] = lambda b: (b,),
    ) -> None:
        self.plan, self.transport, self.placement, self.io = plan, transport, placement, io
        self.pages = pages  # local table entry -> its block ids (a state bundle's pages)
        self.handshake = handshake  # what we send a peer: our compat hash and engine id
        self.timeout_s = timeout_s
        self.loads: dict[str, _Load] = {}
        self.peers: dict[str, Peer] = {}  # engine id -> what its handshake proved
        self._asked: set[tuple[str, str, int]] = set()  # (engine id, host, port) of handshakes in flight
        self.stats = read_stats.new_counters()  # `read_stats`: what each means
        self.histograms = read_stats.new_histograms()

    @property
    def reading(self) -> bool:
        return any(load.state is LoadState.READING for load in self.loads.values())

    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        params = req.kv_transfer_params
        if not isinstance(params, RemotePrefill):
            return 0
        same = params.prompt_hash == prompt_hash(req.prompt_token_ids) and params.num_tokens == req.num_prompt_tokens
        need = max(0, reusable_tokens(req.num_prompt_tokens) - num_local_tokens)
        if not same or need == 0:
            if not same:
                logger.warning("request %s: prompt differs from the prefill's: computing it", req.request_id)
            self.io.release(lease_target(params))  # nothing to read: the peer may free now
            req.kv_transfer_params = None
            return 0
        return need

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        params: RemotePrefill = req.kv_transfer_params
        load = _Load(req.request_id, params, started=time.monotonic())
        self.loads[req.request_id] = load
        peer = self.peers.get(params.engine_id)
        if peer is not None and (params.host, params.port) != (peer.host, peer.port):
            self._fail(load, f"kv_transfer_params place engine {params.engine_id} at {params.host}:{params.port}, "
                             f"but it answered its handshake at {peer.host}:{peer.port}")  # fmt: skip
            return  # not tracked: nobody is contacted
        self.io.track(req.request_id, lease_target(params))
        try:
            end = num_local_tokens + req.num_external_tokens
            remote = [list(g) for g in params.block_ids]
            moves = block_moves(block_ids, remote, num_local_tokens, end, self.plan.block_size)
        except ValueError as e:
            self._fail(load, f"bad remote_block_ids: {e}")
            return
        try:
            load.moves = self._page_moves(moves, params)
        except ValueError as e:
            self._fail(load, f"bad remote_state_pages: {e}")
            return
        if peer is not None:
            self._confirm(load, peer)
        elif (params.engine_id, params.host, params.port) not in self._asked:
            self._asked.add((params.engine_id, params.host, params.port))
            self.io.handshake(params.engine_id, params.host, params.port, self.handshake)

    def _page_moves(self, moves: list[tuple[int, int, int]], params: RemotePrefill) -> list[tuple[int, int, int]]:
        """`moves` with each state entry (a bundle on both sides) expanded to its pages, paired in page order."""
        state = self.plan.state
        if state is None:
            if params.state_pages:
                raise ValueError("this instance keeps no recurrent state")
            return moves
        named = [b for b in params.block_ids[state.group] if b != 0]
        if len(named) != len(params.state_pages):
            raise ValueError(f"{len(params.state_pages)} page lists for {len(named)} state entries")
        remote_pages = dict(zip(named, params.state_pages, strict=True))
        out = []
        for g, local, remote in moves:
            if g != state.group:
                out.append((g, local, remote))
                continue
            mine = self.pages(local)
            if len(mine) != state.num_pages:
                raise ValueError(f"local state entry {local} has {len(mine)} pages, not {state.num_pages}")
            out.extend((g, lp, rp) for lp, rp in zip(mine, remote_pages[remote], strict=True))
        return out

    def _confirm(self, load: _Load, peer: Peer) -> None:
        """Check the load against what the peer proved, then ask it to confirm the lease."""
        if (load.params.host, load.params.port) != (peer.host, peer.port):  # waited for another's handshake
            where = f"{load.params.host}:{load.params.port}"
            self._fail(load, f"engine {load.params.engine_id} answered at {peer.host}:{peer.port}, not {where}")
            return
        if any(remote >= peer.num_blocks for _, _, remote in load.moves):
            self._fail(load, f"remote_block_ids name blocks outside the peer's pool of {peer.num_blocks}")
            return
        load.state = LoadState.CONFIRMING
        self.io.confirm(load.request_id)

    def abort(self, request_id: str) -> bool:
        load = self.loads.get(request_id)
        if load is None:
            return True
        if load.state is LoadState.READING:
            load.aborted = True  # the read may still land in these blocks: free them when it is over
            return False
        self.loads.pop(request_id)
        if load.state is not LoadState.RELEASING:
            self.io.release_tracked(request_id, False)
        return True

    def poll(self, events: ConnectorEvents) -> None:
        for result in self.io.results():
            self._on_result(result, events)
        for load in list(self.loads.values()):
            if load.state is LoadState.READY:
                self._start_read(load)
            elif load.state is LoadState.READING:
                self._check_read(load, events)
            if load.state is LoadState.FAILED:
                del self.loads[load.request_id]
                events.loaded[load.request_id] = False
                events.errors[load.request_id] = load.error or "KV load failed"

    def _on_result(self, result: PeerResult, events: ConnectorEvents) -> None:
        if result.kind is ResultKind.HANDSHAKE:
            self._on_handshake(result)
            return
        load = self.loads.get(result.key)
        if load is None:
            return
        if result.kind is ResultKind.LEASE and load.state is LoadState.CONFIRMING:
            if result.ok:
                load.state = LoadState.READY
            else:
                self._fail(load, result.error or "the prefill instance's lease had ended before the read")
        elif result.kind is ResultKind.RELEASE:
            del self.loads[result.key]
            events.loaded[result.key] = result.ok
            if not result.ok:
                lost = "the prefill instance's lease ended before the read finished"
                events.errors[result.key] = result.error or lost
                self.stats["kv_transfer_failures_total"] += 1
                logger.warning("request %s: KV load discarded: %s", result.key, events.errors[result.key])

    def _on_handshake(self, result: PeerResult) -> None:
        """The first handshake that proves an engine id fixes its address; a failed one fails only the loads that
        named its address."""
        engine_id = result.key
        host, port = result.address or ("?", 0)
        self._asked.discard((engine_id, host, port))
        error, reply = result.error, result.handshake
        if engine_id in self.peers:
            error = None  # proven already (at this address or another): _confirm tells the loads apart
        elif result.ok and reply is not None:
            if reply.engine_id != engine_id:
                error = f"the instance at {host}:{port} is engine {reply.engine_id}, not {engine_id}"
            elif set(reply.placement.layers) != set(self.placement.layers):
                error = "its KV placement names other layers than ours"
            elif not reply.placement.fits(reply.num_blocks):
                error = "its KV placement has addresses past 2**64"
            elif self.plan.state is not None and not reply.placement.tiles(
                self.plan.bytes_per_block, reply.num_blocks, max_regions=len(self.plan.attention_layers) + 1
            ):  # a per-layer block has at most one region per layer page, plus its padding
                error = f"its state regions do not tile a block of {self.plan.bytes_per_block} bytes"
            else:
                try:
                    agent = self.transport.add_peer(reply.agent_metadata)
                    self.peers[engine_id] = Peer(host, port, agent, reply.placement, reply.num_blocks)
                    logger.info("handshake with %s at %s:%d done (its layout %s, ours %s)", engine_id, host, port,
                                reply.layout, self.plan.layout)  # fmt: skip
                except Exception as e:
                    error = f"NIXL could not add peer {engine_id}: {e}"
        if error is not None:
            logger.warning("handshake with %s failed: %s", engine_id, error)
        for load in list(self.loads.values()):
            if load.params.engine_id != engine_id or load.state is not LoadState.HANDSHAKE:
                continue
            if engine_id in self.peers:
                self._confirm(load, self.peers[engine_id])
            elif (load.params.host, load.params.port) == (host, port):
                self._fail(load, f"handshake with the prefill instance failed: {error}")

    def _start_read(self, load: _Load) -> None:
        peer = self.peers[load.params.engine_id]
        device = self.transport.device_id
        try:
            descs = pair_descriptors(self.plan, self.placement, peer.placement, load.moves, device, device)
        except (ValueError, OverflowError) as e:  # the peer's placement, though checked, cannot serve this load
            self._fail(load, f"cannot pair descriptors with the peer: {e}")
            return
        if descs.count == 0:
            load.state = LoadState.RELEASING
            self.io.release_tracked(load.request_id, True)
            return
        submitted = time.monotonic()  # transfer time counts from submission: a read may move bytes inside read()
        try:
            load.handle = self.transport.read(descs, peer.agent)
        except Exception as e:
            self.stats["vllm:nixl_num_failed_transfers_total"] += 1
            self._fail(load, f"NIXL read failed to start: {e}")
            return
        self.histograms["vllm:nixl_post_time_seconds"].observe(time.monotonic() - submitted)
        self.histograms["vllm:nixl_bytes_transferred"].observe(descs.nbytes)
        self.histograms["vllm:nixl_num_descriptors"].observe(descs.count)
        load.state, load.started = LoadState.READING, submitted
        self.stats["kv_transfer_reads_total"] += 1
        self.stats["kv_transfer_bytes_total"] += descs.nbytes
        self.stats["kv_transfer_descriptors_total"] += descs.count
        self.stats["kv_transfer_blocks_total"] += len(load.moves)

    def _check_read(self, load: _Load, events: ConnectorEvents) -> None:
        state = self.transport.state(load.handle)
        if state == "PROC" and time.monotonic() - load.started < self.timeout_s:
            return
        if state == "PROC" and not self.transport.release(load.handle):
            return  # cannot cancel: keep the blocks until NIXL lets go
        if state != "PROC":
            self.transport.release(load.handle)
        self.stats["kv_transfer_seconds_total"] += time.monotonic() - load.started
        if load.aborted:
            del self.loads[load.request_id]
            events.released.append(load.request_id)
            self.io.release_tracked(load.request_id, False)
        elif state == "DONE":
            self.histograms["vllm:nixl_xfer_time_seconds"].observe(time.monotonic() - load.started)
            load.state = LoadState.RELEASING
            self.io.release_tracked(load.request_id, True)
        else:
            self.stats["vllm:nixl_num_failed_transfers_total"] += 1
            self._fail(load, "the read from the prefill instance failed" if state == "ERR" else "the read timed out")

    def _fail(self, load: _Load, reason: str) -> None:
        self.stats["kv_transfer_failures_total"] += 1
        logger.warning("request %s: KV load failed: %s", load.request_id, reason)
        load.state, load.error = LoadState.FAILED, reason
        self.io.release_tracked(load.request_id, False)
