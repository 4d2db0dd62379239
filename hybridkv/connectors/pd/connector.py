"""NixlConnector: prefill/decode disaggregation. The decode instance READs the prompt's KV from the prefill instance.

Producer (prefill) side: a request sent with kv_transfer_params {"do_remote_decode": true} keeps its blocks under a
lease when it finishes, and its response carries a signed `RemotePrefill` (engine id, side channel, block ids per
group, prompt length and hash, lease id, expiry). Consumer (decode) side, in `NixlReader`: a request carrying
params that parse and verify handshakes with the peer once (compatibility hash, NIXL metadata, where each owner
layer lives), reads the blocks its table needs (only in-window blocks of sliding groups, nothing its local prefix
cache already has), then releases the lease. Only if the lease was still held at release is the read trusted;
otherwise, or on any failure, the request recomputes (kv_load_failure_policy=recompute, the default) or fails with
the reason (fail).

Trust: every side-channel message is MAC'd with the mesh secret and params are signed with it
(`mesh_auth.py`); without a secret the side channel must listen on loopback, and one warning says what that
exposes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from hybridkv.connectors.base import (
    ConnectorEvents,
    EngineIdentity,
    KVConnector,
    KVTransferConfig,
    TransferRefused,
    finished_ok,
    register_connector,
)
from hybridkv.connectors.identity import compat_hash
from hybridkv.connectors.mesh_auth import MeshKeys, load_secret
from hybridkv.connectors.pd import read_stats
from hybridkv.connectors.pd.descriptors import Placement
from hybridkv.connectors.pd.leases import LeaseTable
from hybridkv.connectors.pd.options import NixlOptions
from hybridkv.connectors.pd.params import ParamLimits, is_loopback, parse_transfer_params
from hybridkv.connectors.pd.peer_io import PeerIO
from hybridkv.connectors.pd.protocol import (
    HandshakeReply,
    HandshakeRequest,
    LeaseReply,
    LeaseRequest,
    Op,
    Refusal,
    parse_request,
)
from hybridkv.connectors.pd.reader import NixlReader
from hybridkv.connectors.pd.side_channel_server import SideChannelServer
from hybridkv.connectors.pd.transfer_params import (
    RemoteBatch,
    RemoteDecode,
    RemotePrefill,
    TransferParams,
    batch_json,
    prompt_hash,
)
from hybridkv.connectors.pd.transport import NixlTransport
from hybridkv.connectors.pd.used_leases import UsedLeases
from hybridkv.kv.histogram import HistogramSnapshot
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan
from hybridkv.request.state import Request

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.0005  # how often a prefill instance drives UCX while it holds leases (a peer may read)
POLL_READS_EVERY_S = 0.00005  # how often a reader polls its reads in flight (they last ~0.1-10 ms)
INCOMPATIBLE = "incompatible KV: the model, dtype, block size or KV groups differ"
MAX_LEASED_FRACTION = 0.5  # of the pool that leases may hold: requests that keep their blocks for readers


@register_connector("NixlConnector")
class NixlConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, identity: EngineIdentity) -> None:
        options = NixlOptions.of(config)
        self.identity = identity
        self.host, self.port = options.host, options.port  # port: as bound, once the server is up
        self.lease_s, self.timeout_s = options.lease_s, options.timeout_s
        self.load_failure_policy, self.backends = options.load_failure_policy, list(options.backends)
        self.keys = MeshKeys.derive(load_secret(options.secret_file))
        if not self.keys.authenticated and not is_loopback(self.host):
            raise ValueError(
                f"the KV side channel would listen on {self.host} without a mesh secret: any host that reaches it "
                "could read and overwrite this instance's KV cache. Set HYBRIDKV_KV_SECRET (or "
                "kv_connector_extra_config.secret_file) on every instance, or bind side_channel_host to 127.0.0.1"
            )
        self.leases = LeaseTable(self.lease_s, max_hold_s=2 * self.lease_s + self.timeout_s)
        self.params_refused = 0
        self.used_leases = UsedLeases()  # lease ids whose params this decoder accepted: each is read once
        self.leases_refused = 0  # finished requests not leased: leases held MAX_LEASED_FRACTION of the pool
        self._event = threading.Event()
        self._wake = self._event.set

    def register(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        self.plan = plan
        max_blocks = -(-plan.max_model_len // plan.block_size) + 1
        pages = plan.state.num_pages if plan.state is not None else 0
        self.limits = ParamLimits(len(plan.groups), max_blocks, plan.max_model_len, pages)
        self.compat = compat_hash(plan, self.identity.model_fingerprint, self.identity.dtype)
        self.transport = NixlTransport(f"hybridkv-{self.identity.engine_id}", self.backends, self.host)
        self.transport.register(memory.buffers)
        self.placement = Placement.of(plan, [b.data_ptr() for b in memory.buffers])
        self.server = SideChannelServer(self.host, self.port, self._handle, self.keys)
        self.port = self.server.port
        io = PeerIO(lambda: self._wake(), self.keys, self.lease_s / 3)  # through the attribute: set_waker replaces it
        handshake = HandshakeRequest(self.compat, self.identity.engine_id)
        self.reader = NixlReader(plan, self.transport, self.placement, handshake, io, self.timeout_s, self.pages)
        secret = "mesh secret set" if self.keys.authenticated else "no mesh secret"
        logger.info("NixlConnector %s: side channel %s:%d, layout %s, %s", self.identity.engine_id, self.host,
                    self.port, plan.layout, secret)  # fmt: skip
        if not self.keys.authenticated:
            logger.warning(
                "KV side channel %s:%d has no mesh secret: any process on this host can fetch this instance's NIXL "
                "metadata and then read or overwrite its KV cache, and forge kv_transfer_params for its decoder. "
                "Set HYBRIDKV_KV_SECRET (or kv_connector_extra_config.secret_file) on every instance.",
                self.host,
                self.port,
            )

    # ---- what arrives over HTTP ----------------------------------------------------------------------------
    def accept_transfer_params(self, raw: Any, num_prompts: int = 1) -> list[TransferParams | None]:
        params = parse_transfer_params(raw, self.limits)
        if isinstance(params, RemoteBatch):
            if len(params.items) != num_prompts:
                raise ValueError(f"kv_transfer_params.batch: {len(params.items)} entries for {num_prompts} prompts")
            return [None if p is None else self._verified(p) for p in params.items]
        if isinstance(params, RemotePrefill):
            if num_prompts != 1:
                raise ValueError(f"kv_transfer_params: one prompt's params for {num_prompts} prompts; send the batch "
                                 "params the prefill instance returned")  # fmt: skip
            return [self._verified(params)]
        return [params] * num_prompts  # RemoteDecode: a lease for each prompt

    def _verified(self, params: RemotePrefill) -> RemotePrefill | None:
        problem = None
        if not params.signature_ok(self.keys.params):
            problem = "kv_transfer_params: the signature does not verify (altered or forged, or another mesh secret)"
        elif params.expired():
            problem = "kv_transfer_params: expired (the prefill instance's lease has ended)"
        elif not self.keys.authenticated and not is_loopback(params.host):
            problem = "kv_transfer_params: without a mesh secret this decoder reads only from instances on this host"
        elif not self.used_leases.claim(params.lease_id, params.expires_at):  # last: only verified params claim
            problem = ("kv_transfer_params: already used (each lease is read at most once; send the prompt to a "
                       "prefill instance again for new params)")  # fmt: skip
        if problem is None:
            return params
        self.params_refused += 1
        logger.warning("refused kv_transfer_params for engine %s: %s", params.engine_id, problem)
        if self.load_failure_policy == "fail":
            raise TransferRefused(problem)
        return None  # recompute

    def merge_transfer_params(self, outs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        if not any(outs):
            return None
        return outs[0] if len(outs) == 1 else batch_json(outs)

    def cancel_transfer(self, raw: Any) -> bool:
        params = parse_transfer_params(raw, self.limits)
        items = params.items if isinstance(params, RemoteBatch) else (params,)
        released = False
        for p in items:
            if isinstance(p, RemotePrefill) and p.engine_id == self.identity.engine_id:
                released = self.leases.release(p.lease_id, p.signature) or released
        self._wake()
        return released

    # ---- producer side -------------------------------------------------------------------------------------
    def hands_off_prompt(self, req: Request) -> bool:
        # A decoder resumes from the recurrent state before the last prompt token, which later tokens move on.
        return self.plan.state is not None and isinstance(req.kv_transfer_params, RemoteDecode)

    def request_finished(self, req: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        if not isinstance(req.kv_transfer_params, RemoteDecode) or not finished_ok(req):
            return False, None
        held = sum((b != 0) * g.pages_per_entry for g, table in zip(self.plan.groups, block_ids) for b in table)
        if self.leases.blocks + held > MAX_LEASED_FRACTION * self.plan.num_blocks:
            self.leases_refused += 1
            logger.warning("request %s: not leased, leases already hold %d of %d blocks; its decoder computes the "
                           "prompt", req.request_id, self.leases.blocks, self.plan.num_blocks)  # fmt: skip
            return False, None
        lease_id = self.leases.new_id()
        params = RemotePrefill(
            engine_id=self.identity.engine_id,
            host=self.host,
            port=self.port,
            request_id=req.request_id,
            lease_id=lease_id,
            block_ids=tuple(tuple(g) for g in block_ids),
            state_pages=self._state_pages(block_ids),
            num_tokens=req.num_prompt_tokens,
            prompt_hash=prompt_hash(req.prompt_token_ids),
            expires_at=int(time.time() + self.lease_s) + 1,
        ).signed(self.keys.params)
        self.leases.grant(lease_id, req.request_id, params.signature, held)
        return True, params.to_json()

    def _state_pages(self, block_ids: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        """The pages of each state entry the tables hold (what a decoder reads where the tables name a bundle)."""
        if self.plan.state is None:
            return ()
        return tuple(self.pages(b) for b in block_ids[self.plan.state.group] if b != 0)

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """An authenticated side-channel request (on its connection's thread)."""
        req = parse_request(msg)
        if isinstance(req, HandshakeRequest):
            if req.compat != self.compat:
                logger.warning("refused a handshake: %s (peer %s has compat hash %s, this instance %s)",
                               INCOMPATIBLE, req.engine_id, req.compat, self.compat)  # fmt: skip
                return Refusal(INCOMPATIBLE).to_json()
            metadata = self.transport.metadata()
            return HandshakeReply(self.identity.engine_id, metadata, self.placement, self.plan.num_blocks,
                                  self.plan.layout).to_json()  # fmt: skip
        assert isinstance(req, LeaseRequest)
        if req.op is Op.RENEW:
            return LeaseReply(self.leases.renew(req.lease_id, req.signature)).to_json()
        held = self.leases.release(req.lease_id, req.signature)
        self._wake()
        return LeaseReply(held).to_json()

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

    def dead_threads(self) -> list[str]:
        return [] if self.server.alive else ["KV side channel"]

    def fetch_stages(self) -> dict[str, int]:
        return read_stats.fetch_stages([load.state for load in list(self.reader.loads.values())])

    def histograms(self) -> dict[str, HistogramSnapshot]:
        return {name: h.snapshot() for name, h in self.reader.histograms.items()}

    def where(self) -> str:
        return f"side channel {self.host}:{self.port}"  # the port as bound (0 in the config: a free one)

    def metrics(self) -> dict[str, float]:
        return self.reader.stats | {
            "kv_leases_held": float(len(self.leases)),
            "kv_leases_expired_total": float(self.leases.expired_total),
            "kv_leased_blocks": float(self.leases.blocks),
            "kv_leases_refused_total": float(self.leases_refused),
            "kv_loads_in_flight": float(len(self.reader.loads)),
            "kv_transfer_params_refused_total": float(self.params_refused),
            "kv_side_channel_refused_total": float(self.server.refused_total),
            "kv_side_channel_busy_total": float(self.server.busy_total),
            "kv_peer_jobs_refused_total": float(self.reader.io.admission.refused_total),  # no worker, backed off
            # vLLM's NIXL counters, under their meanings here
            "vllm:nixl_num_kv_expired_reqs_total": float(self.leases.expired_total),
            "vllm:nixl_num_notifications_after_expiry_total": float(self.leases.late_releases),
            "vllm:nixl_num_failed_notifications_total": float(self.reader.io.failed_releases),
        }

    def shutdown(self) -> None:
        self.server.close()
        self.reader.io.stop()
