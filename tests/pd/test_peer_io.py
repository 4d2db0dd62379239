"""PeerIO against real side-channel servers and hostile peers, without NIXL: a silent peer delays only the requests
that named it, a hostile reply fails its own job, and the worker goes on."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd import peer_io
from hybridkv.connectors.pd.peer_io import PeerIO, ResultKind, Target
from hybridkv.connectors.pd.protocol import HandshakeRequest
from hybridkv.connectors.pd.side_channel_server import SideChannelServer

KEYS = MeshKeys.derive(b"peer io test secret, 16+ bytes")


@pytest.fixture
def good():
    s = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "held": True}, KEYS)
    yield s
    s.close()


@pytest.fixture
def silent():
    """Accepts connections and never answers."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def run() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield sock.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    sock.close()


def wait_for(io: PeerIO, n: int, timeout: float) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += io.results()
        time.sleep(0.01)
    return out


def target(port: int) -> Target:
    return Target("127.0.0.1", port, "1" * 32, "2" * 64)


def test_a_silent_peer_delays_only_the_requests_that_named_it(good, silent):
    io = PeerIO(lambda: None, KEYS, renew_every_s=60, timeout_s=2)
    io.track("stuck", target(silent))
    io.track("fine", target(good.port))
    start = time.monotonic()
    io.confirm("stuck")
    io.confirm("fine")
    first = wait_for(io, 1, 1.0)
    assert [(r.key, r.ok) for r in first] == [("fine", True)] and time.monotonic() - start < 1.0
    late = wait_for(io, 1, 5.0)
    assert late[0].key == "stuck" and not late[0].ok and "timed out" in late[0].error
    io.stop()


def test_hostile_replies_fail_their_own_job_and_the_worker_goes_on():
    nested = json.loads("[" * 100 + "]" * 100)
    replies = iter([{"ok": True, "x": nested}, {"ok": True, "held": "yes"}, {"ok": True, "held": True}])
    s = SideChannelServer("127.0.0.1", 0, lambda msg: next(replies), KEYS)
    try:
        io = PeerIO(lambda: None, KEYS, renew_every_s=60)
        io.handshake("e", "127.0.0.1", s.port, HandshakeRequest("0" * 64, "me"))
        io.track("r", target(s.port))
        io.confirm("r")
        io.confirm("r")
        results = wait_for(io, 3, 5.0)
        assert [(r.kind, r.ok) for r in results] == [
            (ResultKind.HANDSHAKE, False),
            (ResultKind.LEASE, False),
            (ResultKind.LEASE, True),
        ]
        assert "nested deeper" in results[0].error and "held: malformed" in results[1].error
        io.stop()
    finally:
        s.close()


def test_past_the_peer_cap_jobs_fail_at_once(silent, good, monkeypatch):
    monkeypatch.setattr(peer_io, "MAX_PEERS", 1)
    io = PeerIO(lambda: None, KEYS, renew_every_s=60, timeout_s=2)
    io.track("a", target(silent))
    io.track("b", target(good.port))
    io.confirm("a")  # occupies the only worker for 2 s
    io.confirm("b")
    result = wait_for(io, 1, 0.5)
    assert result[0].key == "b" and "too many prefill instances" in result[0].error
    io.stop()


def test_tracked_leases_are_renewed_while_idle_and_idle_workers_end(good, monkeypatch):
    monkeypatch.setattr(peer_io, "IDLE_EXIT_S", 0.3)
    renewals = []
    s = SideChannelServer("127.0.0.1", 0, lambda msg: renewals.append(msg["op"]) or {"ok": True, "held": True}, KEYS)
    try:
        io = PeerIO(lambda: None, KEYS, renew_every_s=0.1)
        io.track("r", target(s.port))
        io.confirm("r")
        time.sleep(0.5)
        assert renewals.count("renew") >= 3  # the confirm and idle renewals
        io.release_tracked("r", report=False)
        time.sleep(0.8)
        assert not io._workers  # nothing tracked there: the worker ended
        io.stop()
    finally:
        s.close()


@pytest.mark.parametrize("held", [False, True])
def test_a_release_reports_whether_the_lease_was_still_held(held: bool):
    """The RELEASE result carries the peer's `held` verbatim: a lease gone at release must not read as ok."""
    s = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "held": held}, KEYS)
    try:
        io = PeerIO(lambda: None, KEYS, renew_every_s=60)
        io.track("r", target(s.port))
        io.release_tracked("r", report=True)
        results = wait_for(io, 1, 5.0)
        assert [(r.kind, r.key, r.ok, r.error) for r in results] == [(ResultKind.RELEASE, "r", held, None)]
        io.stop()
    finally:
        s.close()
