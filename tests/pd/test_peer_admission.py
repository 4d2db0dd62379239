"""PeerIO's admission (issue 31, attack 6), in-process on loopback, no NIXL: unproven addresses never take the
workers kept for peers that answered a handshake, a failed address is backed off (growing) without contact, and
jobs queued at one unproven address are capped."""

from __future__ import annotations

import socket
import time

import pytest

from hybridkv.connectors.pd import peer_io
from hybridkv.connectors.pd.descriptors import Placement
from hybridkv.connectors.pd.peer_admission import AdmissionPolicy, PeerAdmission
from hybridkv.connectors.pd.peer_io import PeerIO, ResultKind
from hybridkv.connectors.pd.protocol import HandshakeReply, HandshakeRequest
from hybridkv.connectors.pd.side_channel_server import SideChannelServer
from tests.pd.test_peer_io import KEYS, target, wait_for

HELLO = HandshakeRequest("0" * 64, "me")


@pytest.fixture
def prefill():
    """A side channel that answers handshakes (as engine "real") and lease operations; counts its requests."""
    asked: list[str] = []

    def handle(msg: dict) -> dict:
        asked.append(msg["op"])
        if msg["op"] == "handshake":
            return HandshakeReply("real", b"metadata", Placement({0: (0, 1)}, ()), 8, "packed").to_json()
        return {"ok": True, "held": True}

    s = SideChannelServer("127.0.0.1", 0, handle, KEYS)
    s.asked = asked
    yield s
    s.close()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def test_unproven_addresses_never_take_the_reserved_workers(prefill, monkeypatch):
    monkeypatch.setattr(peer_io, "IDLE_EXIT_S", 0.2)
    policy = AdmissionPolicy(max_peers=4, reserved=2)
    io = PeerIO(lambda: None, KEYS, renew_every_s=0.1, timeout_s=3, policy=policy)
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(4)]  # silent: they never accept
    try:
        io.handshake("real", "127.0.0.1", prefill.port, HELLO)
        (proved,) = wait_for(io, 1, 3.0)
        assert proved.ok and io.admission.proven(("127.0.0.1", prefill.port))
        wait_for(io, 1, 0.6)  # its worker ends when idle: the next job needs a new one
        assert not io._workers
        for i, sock in enumerate(listeners):  # each holds a worker for 3 s: only max_peers - reserved get one
            io.handshake(f"forged-{i}", "127.0.0.1", sock.getsockname()[1], HELLO)
        refused = wait_for(io, 2, 1.0)
        assert {r.key for r in refused} == {"forged-2", "forged-3"}
        assert all("kept for instances that answered a handshake" in r.error for r in refused)
        io.track("r", target(prefill.port))
        io.confirm("r")  # the proven prefill instance still gets a worker at once
        (confirmed,) = wait_for(io, 1, 1.0)
        assert confirmed.kind is ResultKind.LEASE and confirmed.ok
    finally:
        io.stop()
        for sock in listeners:
            sock.close()


def test_a_failed_address_is_backed_off_without_contact_and_the_delay_grows():
    io = PeerIO(lambda: None, KEYS, renew_every_s=60, policy=AdmissionPolicy(backoff_s=0.3, max_backoff_s=10))
    port = closed_port()
    try:
        io.handshake("e1", "127.0.0.1", port, HELLO)
        (first,) = wait_for(io, 1, 2.0)
        assert not first.ok and "refused" in first.error.lower()  # ECONNREFUSED: contacted, failed
        io.handshake("e2", "127.0.0.1", port, HELLO)
        (second,) = wait_for(io, 1, 0.5)
        assert "failed recently" in second.error  # not contacted
        time.sleep(0.15)
        assert not io._workers  # a failed unproven address keeps no worker (past UNPROVEN_LINGER_S)
        time.sleep(0.2)  # past the first back-off: contacted again, fails again, backed off for 0.6 s
        io.handshake("e3", "127.0.0.1", port, HELLO)
        (third,) = wait_for(io, 1, 2.0)
        assert "failed recently" not in third.error
        assert io.admission.backoff_left(("127.0.0.1", port), time.monotonic()) > 0.4
    finally:
        io.stop()


def test_jobs_queued_at_one_unproven_address_are_capped():
    admission = PeerAdmission(AdmissionPolicy(max_unproven_jobs=2))
    address = ("127.0.0.1", 1)
    assert admission.refusal(address, 1, [address], 0.0) is None
    assert "already wait" in admission.refusal(address, 2, [address], 0.0)
    admission.succeeded(address, handshake=True)
    assert admission.refusal(address, 2, [address], 0.0) is None  # a proven peer's real traffic
