"""UsedLeases: the lease ids a decoder has accepted params for, so each lease is read at most once.

The same params sent twice (a retry, a replay, or eight copies at once) would otherwise each confirm, read and
release the one lease: several reads of one prompt's blocks, all but one untrusted. The first use claims the
lease id when its params verify; a later use of the same id is refused before anything is contacted, whether the
first read is in flight or done. An entry is kept until its params expire (they are refused as expired after
that anyway), and the table is bounded: when full, the entries that expire last go first, so params forged with a
far-off expiry (possible without a mesh secret) cannot push out the leases in use. Thread-safe: HTTP threads
verify params.
"""

from __future__ import annotations

import threading
import time

from hybridkv.connectors.pd.transfer_params import EXPIRY_SLACK_S

MAX_USED = 1 << 16  # lease ids remembered at once


class UsedLeases:
    def __init__(self, max_entries: int = MAX_USED) -> None:
        if max_entries < 2:
            raise ValueError("UsedLeases needs room for at least 2 lease ids")
        self.max_entries = max_entries
        self._expires: dict[str, int] = {}  # lease id -> its params' expires_at (wall-clock seconds)
        self._lock = threading.Lock()

    def claim(self, lease_id: str, expires_at: int) -> bool:
        """True for the first use of `lease_id`; False while it is remembered (in flight, read or released)."""
        with self._lock:
            if lease_id in self._expires:
                return False
            if len(self._expires) >= self.max_entries:
                self._prune()
            self._expires[lease_id] = expires_at
            return True

    def _prune(self) -> None:
        now = time.time()
        live = {k: e for k, e in self._expires.items() if e + EXPIRY_SLACK_S >= now}
        if len(live) >= self.max_entries:  # keep the half that expires soonest
            keep = sorted(live.items(), key=lambda kv: kv[1])[: self.max_entries // 2]
            live = dict(keep)
        self._expires = live

    def __len__(self) -> int:
        with self._lock:
            return len(self._expires)
