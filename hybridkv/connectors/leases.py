"""Leases: how long a prefill instance keeps a finished request's blocks for a remote reader.

A lease starts when the request finishes; the reader renews it while it waits and releases it after reading. The
release reply says whether the lease was still held: only then may the reader trust what it read, since an
expired lease lets the blocks be reused. Touched from the side-channel thread and the engine thread, so every
method takes the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    deadline: float
    released: bool = False


class LeaseTable:
    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.expired_total = 0
        self.released_total = 0

    def grant(self, request_id: str) -> None:
        with self._lock:
            self._leases[request_id] = Lease(time.monotonic() + self.duration_s)

    def renew(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.released or lease.deadline < time.monotonic():
                return False
            lease.deadline = time.monotonic() + self.duration_s
            return True

    def release(self, request_id: str) -> bool:
        """End the lease; True when it was still held (not expired, not released before)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.released:
                return False
            valid = lease.deadline >= time.monotonic()
            lease.released = True
            return valid

    def collect(self) -> list[str]:
        """Requests whose blocks may be freed now: released or expired. Each is returned once."""
        now = time.monotonic()
        out = []
        with self._lock:
            for rid, lease in list(self._leases.items()):
                if lease.released or lease.deadline < now:
                    if not lease.released:
                        self.expired_total += 1
                    else:
                        self.released_total += 1
                    lease.released = True
                    del self._leases[rid]
                    out.append(rid)
        return out

    def next_deadline(self) -> float | None:
        with self._lock:
            if not self._leases:
                return None
            return max(0.0, min(lease.deadline for lease in self._leases.values()) - time.monotonic())

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
