"""PeerIO: the decode side's side-channel traffic (handshakes, lease renewals, releases), off the engine loop.

Each peer address gets its own worker thread, so a slow, silent or hostile peer delays only the requests that
named it. A worker runs its peer's jobs in order, renews the leases tracked at that peer while it is idle, and
ends once it has had nothing to do for a while (at once, for an address that never answered a handshake).
`PeerAdmission` decides which addresses get a worker and a queued job: slots kept for proven peers, per-address
limits, and a back-off for addresses that failed, so forged params (possible without a mesh secret) cannot use
up the workers a real prefill instance needs. Results come back through `results()`; `notify` wakes the engine
when there are some. A job that fails in any way posts its failure: no exception ends a worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd.peer_admission import AdmissionPolicy, PeerAdmission
from hybridkv.connectors.pd.protocol import (
    HandshakeReply,
    HandshakeRequest,
    LeaseReply,
    LeaseRequest,
    Op,
    parse_handshake_reply,
    parse_lease_reply,
)
from hybridkv.connectors.pd.side_channel import MalformedReply, request

logger = logging.getLogger(__name__)

MAX_PEERS = 64  # workers at once: jobs for further peer addresses fail at once
RESERVED_PEERS = 16  # of them, kept for addresses that answered a handshake before
IDLE_EXIT_S = 30.0  # a proven peer's worker with no job and no tracked lease for this long ends
UNPROVEN_LINGER_S = 0.05  # an unproven address's worker with no job and no tracked lease ends after this


class ResultKind(Enum):
    HANDSHAKE = "handshake"  # key: engine id
    LEASE = "lease"  # key: request id; ok = the lease is held (a confirm before reading)
    RELEASE = "release"  # key: request id; ok = the lease was still held at release: the read may be trusted


@dataclass(frozen=True)
class PeerResult:
    kind: ResultKind
    key: str
    ok: bool
    error: str | None = None  # why the peer could not be asked; None with ok=False: the lease had ended
    handshake: HandshakeReply | None = None
    address: tuple[str, int] | None = None  # of a HANDSHAKE: where it was asked


@dataclass(frozen=True)
class Target:
    """Where a tracked request's lease lives and how to name it."""

    host: str
    port: int
    lease_id: str
    signature: str


Job = tuple[Callable[[], PeerResult | None], ResultKind, str, tuple[str, int] | None]  # run; how to post its failure


class PeerIO:
    def __init__(
        self,
        notify: Callable[[], None],
        keys: MeshKeys,
        renew_every_s: float,
        timeout_s: float = 5.0,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        self.notify, self.keys = notify, keys
        policy = policy or AdmissionPolicy(max_peers=MAX_PEERS, reserved=min(RESERVED_PEERS, MAX_PEERS - 1))
        self.admission = PeerAdmission(policy)  # under self._lock
        self.renew_every_s = renew_every_s
        self.timeout_s = timeout_s
        self._results: list[PeerResult] = []
        self._tracked: dict[str, Target] = {}  # request -> its lease at the peer
        self._handshaking: set[tuple[str, str, int]] = set()  # (engine id, host, port) asked and not answered
        self._workers: dict[tuple[str, int], queue.SimpleQueue[Job | None]] = {}
        self._lock = threading.Lock()
        self.failed_releases = 0  # release messages that did not reach their prefill instance (under _lock)
        self._stopped = False

    def track(self, request_id: str, target: Target) -> None:
        """Renew this request's lease at the peer until it is released."""
        with self._lock:
            self._tracked[request_id] = target

    def handshake(self, engine_id: str, host: str, port: int, message: HandshakeRequest) -> None:
        """Posts a HANDSHAKE result for `engine_id` at (host, port). One in flight per engine and address: a
        request naming a silent address delays no handshake at another."""
        asked = (engine_id, host, port)
        with self._lock:
            if asked in self._handshaking:
                return
            self._handshaking.add(asked)

        def run() -> PeerResult:
            try:
                reply = parse_handshake_reply(request(host, port, message.to_json(), self.keys, self.timeout_s))
            finally:
                with self._lock:
                    self._handshaking.discard(asked)
            if isinstance(reply, HandshakeReply):
                return PeerResult(ResultKind.HANDSHAKE, engine_id, True, handshake=reply, address=(host, port))
            return PeerResult(ResultKind.HANDSHAKE, engine_id, False, reply.error, address=(host, port))

        self._submit(host, port, (run, ResultKind.HANDSHAKE, engine_id, (host, port)))

    def confirm(self, request_id: str) -> None:
        """Renew a tracked request's lease now; posts a LEASE result. A read may start only once the lease is
        known to be held: a peer that has let the blocks go no longer drives its side of the transfer."""
        with self._lock:
            target = self._tracked.get(request_id)
        self._ask(target, Op.RENEW, ResultKind.LEASE, request_id, report=True)

    def release_tracked(self, request_id: str, report: bool) -> None:
        """Release a tracked request's lease; with `report`, post a RELEASE result."""
        with self._lock:
            target = self._tracked.pop(request_id, None)
        self._ask(target, Op.RELEASE, ResultKind.RELEASE, request_id, report)

    def release(self, target: Target) -> None:
        """Fire and forget: the peer may free a lease we will not read."""
        self._ask(target, Op.RELEASE, ResultKind.RELEASE, "", report=False)

    def _ask(self, target: Target | None, op: Op, kind: ResultKind, request_id: str, report: bool) -> None:
        if target is None:
            if report:
                self._post(PeerResult(kind, request_id, False, "the request was not tracked"))
            return

        def run() -> PeerResult | None:
            try:
                held = self._lease_op(target, op)
            except Exception:
                if op is Op.RELEASE:  # the prefill was not told: its blocks wait for the lease to expire
                    with self._lock:
                        self.failed_releases += 1
                raise
            return PeerResult(kind, request_id, held) if report else None

        self._submit(target.host, target.port, (run, kind, request_id if report else "", None))

    def _lease_op(self, target: Target, op: Op) -> bool:
        message = LeaseRequest(op, target.lease_id, target.signature).to_json()
        reply = parse_lease_reply(request(target.host, target.port, message, self.keys, self.timeout_s))
        if not isinstance(reply, LeaseReply):
            raise ConnectionError(f"the prefill instance refused: {reply.error}")
        return reply.held

    def results(self) -> list[PeerResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            workers, self._workers = list(self._workers.values()), {}
        for jobs in workers:
            jobs.put(None)

    def _post(self, result: PeerResult) -> None:
        with self._lock:
            self._results.append(result)
        self.notify()

    def _submit(self, host: str, port: int, job: Job) -> None:
        with self._lock:  # held while queueing: a worker decides to end under it, seeing no job
            jobs = self._workers.get((host, port))
            queued = None if jobs is None else jobs.qsize()
            why = "stopped" if self._stopped else None
            why = why or self.admission.refusal((host, port), queued, list(self._workers), time.monotonic())
            if why is None and jobs is None:
                jobs = self._workers[(host, port)] = queue.SimpleQueue()
                name = f"hybridkv-peer-io-{host}:{port}"
                threading.Thread(target=self._work, args=(host, port, jobs), name=name, daemon=True).start()
            if why is None and jobs is not None:
                jobs.put(job)
                return
        self._fail(job, why or "not queued")

    def _fail(self, job: Job, reason: str) -> None:
        _, kind, key, address = job
        if kind is ResultKind.HANDSHAKE:
            with self._lock:
                self._handshaking.discard((key, *address))  # type: ignore[misc]
        if key:
            self._post(PeerResult(kind, key, False, reason, address=address))

    def _work(self, host: str, port: int, jobs: queue.SimpleQueue[Job | None]) -> None:
        address = (host, port)
        idle_since = next_renew = time.monotonic()
        next_renew += self.renew_every_s
        while True:
            with self._lock:
                proven = self.admission.proven(address)
            wait = next_renew - time.monotonic()
            try:
                job = jobs.get(timeout=max(0.0, wait if proven else min(wait, UNPROVEN_LINGER_S)))
            except queue.Empty:
                now = time.monotonic()
                with self._lock:
                    targets = [t for t in self._tracked.values() if (t.host, t.port) == address]
                    idle_since = now if targets else idle_since
                    # Invariant: an unproven address holds a worker only while it has work (jobs or leases).
                    if not targets and jobs.empty() and (not proven or now - idle_since >= IDLE_EXIT_S):
                        if self._workers.get(address) is jobs:
                            del self._workers[address]
                        return
                if now >= next_renew:
                    next_renew = now + self.renew_every_s
                    for target in targets:
                        self._renew(target)
                continue
            if job is None:
                return
            idle_since = time.monotonic()
            with self._lock:
                left = self.admission.backoff_left(address, idle_since)
            if left > 0:  # it failed while this job waited: fail the job without contact
                self._fail(job, f"KV side channel {host}:{port} failed recently: not contacted for {left:.1f} s")
                continue
            try:
                result = job[0]()
            except Exception as e:  # whatever this peer sent, it fails this job only
                self._outcome(address, e)
                self._fail(job, str(e) if isinstance(e, ConnectionError) else f"KV side channel {host}:{port}: {e}")
                continue
            self._outcome(address, result)
            if result is not None:
                self._post(result)

    def _outcome(self, address: tuple[str, int], outcome: PeerResult | Exception | None) -> None:
        """Back the address off after it could not be reached or would not handshake; a reply that authenticated
        clears that, and a handshake reply proves the address (it may then use the reserved workers)."""
        with self._lock:
            if isinstance(outcome, ConnectionError) and not isinstance(outcome, MalformedReply):
                self.admission.failed(address, time.monotonic())
            elif isinstance(outcome, PeerResult) and outcome.kind is ResultKind.HANDSHAKE and not outcome.ok:
                self.admission.failed(address, time.monotonic())  # an authenticated refusal: incompatible
            elif not isinstance(outcome, Exception):
                handshake = isinstance(outcome, PeerResult) and outcome.kind is ResultKind.HANDSHAKE
                self.admission.succeeded(address, handshake)

    def _renew(self, target: Target) -> None:
        try:
            self._lease_op(target, Op.RENEW)
        except Exception as e:
            self._outcome((target.host, target.port), e)
            logger.info("side channel: %s", e)
            return
        self._outcome((target.host, target.port), None)
