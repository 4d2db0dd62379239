"""The mesh secret, the authenticated side channel and leases, without NIXL: MACs, replays, refusals that say
nothing, slow clients, the connection cap, hostile payloads."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import pytest

from hybridkv.connectors.mesh_auth import SECRET_ENV, MeshKeys, ReplayGuard, load_secret
from hybridkv.connectors.pd import side_channel, side_channel_server
from hybridkv.connectors.pd.leases import LeaseTable
from hybridkv.connectors.pd.side_channel import REQUEST, encode, request
from hybridkv.connectors.pd.side_channel_server import SideChannelServer
from tests.pd.frames import exchange, refused

SECRET = b"correct horse battery staple 42"
KEYS, OTHER, PUBLIC = MeshKeys.derive(SECRET), MeshKeys.derive(b"another secret of 16+ bytes"), MeshKeys.derive(None)
ANSWER = {"ok": True, "engine_id": "secret-engine", "agent_metadata": "c2VjcmV0"}


@pytest.fixture
def server():
    s = SideChannelServer("127.0.0.1", 0, lambda msg: ANSWER | {"echo": msg.get("x")}, KEYS)
    yield s
    s.close()


def test_secret_sources_and_file_checks(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert load_secret() is None
    monkeypatch.setenv(SECRET_ENV, "from the environment 123")
    assert load_secret() == b"from the environment 123"
    good = tmp_path / "secret"
    good.write_bytes(b"from a private file 456\n")
    good.chmod(0o600)
    assert load_secret(str(good)) == b"from a private file 456"  # the file wins; whitespace is not the secret
    good.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable by others.*chmod 600"):
        load_secret(str(good))
    good.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ValueError, match="symlink"):
        load_secret(str(link))
    if os.geteuid() == 0:
        os.chown(good, 65534, -1)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            load_secret(str(good))
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="has 4 bytes; use at least 16"):
        load_secret(str(short))
    with pytest.raises(ValueError, match="No such file"):
        load_secret(str(tmp_path / "missing"))


def test_keys_differ_per_secret_and_per_purpose():
    assert KEYS.authenticated and not PUBLIC.authenticated
    assert len({KEYS.channel, KEYS.params, KEYS.disk, OTHER.channel, PUBLIC.channel}) == 5
    assert SECRET not in repr(KEYS).encode()


def test_replay_guard_refuses_repeats_stale_and_nan():
    guard = ReplayGuard(window_s=1.0)
    now = time.time()
    assert guard.fresh(b"a" * 16, now) and not guard.fresh(b"a" * 16, now)
    assert not guard.fresh(b"b" * 16, now - 5) and not guard.fresh(b"c" * 16, now + 5)
    assert not guard.fresh(b"d" * 16, float("nan"))
    full = ReplayGuard(max_nonces=2)
    assert full.fresh(b"1" * 16, now) and full.fresh(b"2" * 16, now) and not full.fresh(b"3" * 16, now)


def test_an_authenticated_request_is_answered(server):
    assert request("127.0.0.1", server.port, {"x": 7}, KEYS)["echo"] == 7


@pytest.mark.parametrize("keys", [PUBLIC, OTHER], ids=["no secret", "another secret"])
def test_an_unauthenticated_request_gets_one_generic_refusal(server, keys):
    with pytest.raises(ConnectionError, match="refused the request"):
        request("127.0.0.1", server.port, {"x": 7}, keys)
    reply = exchange(server.port, encode(keys, REQUEST, {"op": "handshake"}))
    assert refused(reply) and len(reply) == side_channel.FRAME_HEADER + len(json.dumps(side_channel.REFUSED))
    assert b"secret-engine" not in reply and b"c2VjcmV0" not in reply
    assert reply[side_channel._HEAD.size : side_channel.FRAME_HEADER] == bytes(32)  # unsigned
    assert server.refused_total == 2


def test_a_frame_whose_mac_was_altered_is_refused_though_it_decrypts(server):
    """The MAC is checked on its own: a member's frame with one MAC bit flipped (its payload still decrypts to a
    valid request) is refused like a stranger's."""
    frame = bytearray(encode(KEYS, REQUEST, {"x": 5}))
    frame[side_channel._HEAD.size] ^= 1
    assert refused(exchange(server.port, bytes(frame)))
    assert server.refused_total == 1


def test_replayed_stale_oversized_and_foreign_frames_are_refused(server):
    frame = encode(KEYS, REQUEST, {"x": 1})
    answer = exchange(server.port, frame)
    assert not refused(answer) and b"secret-engine" not in answer and b"c2VjcmV0" not in answer  # encrypted
    assert refused(exchange(server.port, frame))  # the same bytes again: a replay
    head = side_channel._HEAD
    stale = bytearray(encode(KEYS, REQUEST, {"x": 2}))
    magic, version, kind, length, nonce, _ = head.unpack(stale[: head.size])
    stale[: head.size] = head.pack(magic, version, kind, length, nonce, time.time() - 3600)  # MAC now wrong...
    assert refused(exchange(server.port, bytes(stale)))
    old = head.pack(magic, version, kind, length, os.urandom(16), time.time() - 3600)  # ...or right, but stale
    signed_old = old + side_channel.mac(KEYS.channel, old, b"", stale[side_channel.FRAME_HEADER :])
    assert refused(exchange(server.port, signed_old + bytes(stale[side_channel.FRAME_HEADER :])))
    huge = head.pack(b"HKVS", 1, REQUEST, 1 << 30, os.urandom(16), time.time()) + bytes(32)
    assert refused(exchange(server.port, huge))
    assert refused(exchange(server.port, b'{"op": "handshake"}\n' + bytes(100)))  # the old protocol
    assert server.refused_total == 5


def test_deep_json_from_a_peer_with_the_secret_is_refused_not_a_crash(server):
    deep = json.loads("[" * 50 + "]" * 50)
    with pytest.raises(ConnectionError, match="refused"):
        request("127.0.0.1", server.port, {"x": deep}, KEYS)
    assert request("127.0.0.1", server.port, {"x": 3}, KEYS)["echo"] == 3


def test_a_reply_that_does_not_authenticate_is_an_error():
    """A relay (or a fake prefill instance) that alters the reply, or answers with another request's reply."""
    listener = socket.create_server(("127.0.0.1", 0))

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            side_channel.read_frame(conn, time.monotonic() + 5, REQUEST)
            conn.sendall(encode(KEYS, side_channel.REPLY, ANSWER, bound=os.urandom(16)))  # bound to another nonce

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(ConnectionError, match="does not authenticate"):
        request("127.0.0.1", listener.getsockname()[1], {"x": 1}, KEYS)
    t.join()
    listener.close()


def test_slow_clients_delay_no_one_and_are_cut_at_the_deadline(server, monkeypatch):
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.5 s: never a whole frame before the deadline
        while not stop.wait(0.5):
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(b"H")

    t = threading.Thread(target=drip)
    t.start()
    try:
        for _ in range(5):
            start = time.monotonic()
            assert request("127.0.0.1", server.port, {"x": 1}, KEYS)["echo"] == 1
            assert time.monotonic() - start < 0.5
        time.sleep(side_channel_server.CONNECTION_DEADLINE_S + 1)
        for s in slow:  # the server gave up on each after the deadline and closed it
            s.settimeout(1)
            assert refused(s.recv(1 << 16))
    finally:
        stop.set()
        t.join()
        for s in slow:
            s.close()


def test_past_the_connection_cap_the_oldest_incomplete_connection_makes_room(monkeypatch):
    monkeypatch.setattr(side_channel_server, "MAX_CONNECTIONS", 4)
    s = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True}, KEYS)
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        time.sleep(0.2)
        for _ in range(3):  # the first request drops the oldest idle connection; each is answered at once
            start = time.monotonic()
            assert request("127.0.0.1", s.port, {}, KEYS, timeout=1) == {"ok": True}
            assert time.monotonic() - start < 0.5
        assert s.busy_total == 1
        idle[0].settimeout(1)
        assert idle[0].recv(10) == b""  # the oldest was closed
        for c in idle:
            c.close()
    finally:
        s.close()


def test_a_handler_bug_answers_an_error_and_the_server_goes_on():
    def handler(msg):
        if msg.get("boom"):
            raise RuntimeError("internal detail that must not leak")
        return {"ok": True}

    s = SideChannelServer("127.0.0.1", 0, handler, KEYS)
    try:
        assert request("127.0.0.1", s.port, {"boom": True}, KEYS) == {"ok": False, "error": "internal error"}
        assert request("127.0.0.1", s.port, {}, KEYS) == {"ok": True} and s.alive
    finally:
        s.close()


def test_leases_answer_only_to_their_id_and_signature_and_cannot_be_pinned():
    leases = LeaseTable(duration_s=0.3, max_hold_s=0.6)
    ids = {leases.new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 for i in ids)  # 128-bit random, not a counter
    lease = leases.new_id()
    leases.grant(lease, "victim", "a" * 64)
    assert not leases.renew(lease, "b" * 64) and not leases.release(lease, "b" * 64)  # other params
    assert not leases.renew("0" * 32, "a" * 64)  # a guess
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and leases.renew(lease, "a" * 64):  # renewed as fast as possible...
        time.sleep(0.05)
    assert 0.5 < 1.0 - (deadline - time.monotonic()) < 0.75  # ...it still ends at max_hold_s
    assert leases.collect() == ["victim"] and leases.expired_total == 1
