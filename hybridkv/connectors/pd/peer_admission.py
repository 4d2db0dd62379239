"""PeerAdmission: which peer addresses PeerIO may contact now, so no client can use up its workers.

Without a mesh secret anyone can forge kv_transfer_params naming any address on this host; each named address
would get a worker. Three rules keep a forged address from costing more than the requests that name it:
- **Slots kept for proven peers.** An address that answered a handshake (an authenticated HandshakeReply) is
  proven; only proven addresses may take the last `reserved` of the `max_peers` workers, so unproven ones, however
  many, never starve a known-good prefill instance.
- **Per-address limits.** One worker per address, and at most `max_unproven_jobs` jobs queued at an unproven
  address (a proven one: `max_proven_jobs`, its real traffic); a worker of an unproven address ends as soon as it
  has nothing queued and no lease to renew.
- **Back-off.** An address whose connection, handshake or lease operation failed is refused at once, without
  contact, for `backoff_s` doubling with each failure in a row up to `max_backoff_s`; a success resets it.
Both tables are bounded (least recently used first out). Not thread-safe: PeerIO calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

Address = tuple[str, int]


@dataclass(frozen=True)
class AdmissionPolicy:
    max_peers: int = 64  # workers at once
    reserved: int = 16  # of them, only proven addresses may take
    max_unproven_jobs: int = 8  # queued at one unproven address
    max_proven_jobs: int = 4096  # queued at one proven address
    backoff_s: float = 1.0  # after one failure; doubles per failure in a row
    max_backoff_s: float = 60.0
    max_remembered: int = 4096  # proven and failed addresses each

    def __post_init__(self) -> None:
        if not 0 <= self.reserved < self.max_peers:
            raise ValueError("AdmissionPolicy.reserved must be below max_peers")
        if self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("AdmissionPolicy needs 0 < backoff_s <= max_backoff_s")


@dataclass
class _Failures:
    count: int
    until: float  # monotonic seconds: refused until then


class PeerAdmission:
    def __init__(self, policy: AdmissionPolicy | None = None) -> None:
        self.policy = policy or AdmissionPolicy()
        self._proven: OrderedDict[Address, None] = OrderedDict()
        self._failed: OrderedDict[Address, _Failures] = OrderedDict()
        self.refused_total = 0

    def proven(self, address: Address) -> bool:
        return address in self._proven

    def backoff_left(self, address: Address, now: float) -> float:
        failed = self._failed.get(address)
        return 0.0 if failed is None else max(0.0, failed.until - now)

    def refusal(self, address: Address, queued: int | None, workers: list[Address], now: float) -> str | None:
        """Why a job for `address` may not be queued now (None: it may). `queued`: jobs at its worker, None when it
        has none; `workers`: the addresses that have one."""
        host, port = address
        why = None
        if (left := self.backoff_left(address, now)) > 0:
            why = f"KV side channel {host}:{port} failed recently: not contacted for another {left:.1f} s"
        elif queued is not None:
            limit = self.policy.max_proven_jobs if self.proven(address) else self.policy.max_unproven_jobs
            if queued >= limit:
                why = f"KV side channel {host}:{port}: {queued} requests already wait for it"
        elif len(workers) >= self.policy.max_peers:
            why = f"too many prefill instances in flight (more than {self.policy.max_peers})"
        elif not self.proven(address):
            unproven = sum(1 for a in workers if a not in self._proven)
            if unproven >= self.policy.max_peers - self.policy.reserved:
                why = (f"too many unproven prefill instances in flight ({unproven}); the other "
                       f"{self.policy.reserved} slots are kept for instances that answered a handshake")  # fmt: skip
        if why is not None:
            self.refused_total += 1
        return why

    def succeeded(self, address: Address, handshake: bool) -> None:
        """A reply authenticated at `address`; `handshake`: it was a HandshakeReply (the address is now proven)."""
        self._failed.pop(address, None)
        if handshake:
            self._remember(self._proven, address, None)

    def failed(self, address: Address, now: float) -> None:
        old = self._failed.pop(address, None)
        count = 1 if old is None else old.count + 1
        delay = min(self.policy.backoff_s * 2 ** min(count - 1, 30), self.policy.max_backoff_s)
        self._remember(self._failed, address, _Failures(count, now + delay))

    def _remember(self, table: OrderedDict, address: Address, value: object) -> None:
        table[address] = value
        table.move_to_end(address)
        while len(table) > self.policy.max_remembered:
            table.popitem(last=False)
