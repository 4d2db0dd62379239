"""Leases: how long a prefill instance keeps a finished request's blocks for a remote reader.

A lease starts when the request finishes; the reader renews it while it waits and releases it after reading. The
release reply says whether the lease was still held: only then may the reader trust what it read, since an
expired lease lets the blocks be reused. Lease ids are 128-bit random (a capability, not a counter), and a lease
answers only to the signature of the kv_transfer_params it was issued with, so knowing one lease's id lets nobody
renew or release another, and no params but the issued ones pass. Renewals extend a lease to at most `max_hold_s`
after it started: nobody pins blocks forever. Touched from side-channel threads and the engine thread, so every
method takes the lock.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    request_id: str
    signature: str  # of the params issued with this lease
    num_blocks: int
    deadline: float
    hard_deadline: float
    released: bool = False


class LeaseTable:
    def __init__(self, duration_s: float, max_hold_s: float | None = None) -> None:
        self.duration_s = duration_s
        self.max_hold_s = max_hold_s if max_hold_s is not None else 3 * duration_s
        self._leases: dict[str, Lease] = {}  # lease id -> lease
        self._lock = threading.Lock()
        self.expired_total = 0
        self.released_total = 0
        self.late_releases = 0
        self.blocks = 0  # held by the leases not yet collected

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(16)

    def grant(self, lease_id: str, request_id: str, signature: str, num_blocks: int = 0) -> None:
        now = time.monotonic()
        lease = Lease(request_id, signature, num_blocks, now + self.duration_s, now + self.max_hold_s)
        with self._lock:
            self._leases[lease_id] = lease
            self.blocks += num_blocks

    def _held(self, lease_id: str, signature: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.released or not hmac.compare_digest(lease.signature, signature):
            return None
        return lease

    def renew(self, lease_id: str, signature: str) -> bool:
        with self._lock:
            lease = self._held(lease_id, signature)
            now = time.monotonic()
            if lease is None or lease.deadline < now:
                return False
            lease.deadline = min(now + self.duration_s, lease.hard_deadline)
            return True

    def release(self, lease_id: str, signature: str) -> bool:
        """End the lease; True when it was still held (not expired, not released before)."""
        with self._lock:
            lease = self._held(lease_id, signature)
            if lease is None:
                self.late_releases += 1  # expired (or never ours): vLLM's notifications after expiry
                return False
            lease.released = True
            return lease.deadline >= time.monotonic()

    def collect(self) -> list[str]:
        """Requests whose blocks may be freed now: released or expired. Each is returned once."""
        now = time.monotonic()
        out = []
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.released or lease.deadline < now:
                    if lease.released:
                        self.released_total += 1
                    else:
                        self.expired_total += 1
                    del self._leases[lease_id]
                    self.blocks -= lease.num_blocks
                    out.append(lease.request_id)
        return out

    def next_deadline(self) -> float | None:
        with self._lock:
            if not self._leases:
                return None
            return max(0.0, min(lease.deadline for lease in self._leases.values()) - time.monotonic())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
