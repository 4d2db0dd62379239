"""Point 10 of issue 31, side channel: no sender without the secret can fill the nonce table (nonces are recorded
only after a MAC verified under a secret; without one, only the timestamp counts), and a peer's refusal text
reaches logs and errors escaped and cut short. In-process servers on loopback, no NIXL."""

from __future__ import annotations

import logging
import time

import pytest

from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd.peer_io import PeerIO, ResultKind
from hybridkv.connectors.pd.protocol import MAX_PEER_TEXT, HandshakeRequest, LeaseRequest, Op, parse_lease_reply
from hybridkv.connectors.pd.side_channel import REQUEST, encode, request
from hybridkv.connectors.pd.side_channel_server import SideChannelServer
from tests.pd.frames import exchange, refused

KEYS = MeshKeys.derive(b"side channel tables test secret")
PUBLIC, WRONG = MeshKeys.derive(None), MeshKeys.derive(b"another secret, 16 bytes or more")
ASK = LeaseRequest(Op.RENEW, "0" * 32, "0" * 64).to_json()
FORGED_LOG = "incompatible\n2099-01-01 00:00:00 ERROR hybridkv: mesh secret leaked \x1b[2J\x07"


def held(msg: dict) -> dict:
    return {"ok": True, "held": True}


@pytest.fixture
def serve():
    servers: list[SideChannelServer] = []

    def start(keys: MeshKeys, handler=held, max_nonces: int = 4) -> SideChannelServer:
        s = SideChannelServer("127.0.0.1", 0, handler, keys)
        s.replays.max_nonces = max_nonces  # a small table: filling it takes a few messages, not 2**18
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def test_without_a_secret_no_sender_fills_the_nonce_table(serve):
    s = serve(PUBLIC)
    for _ in range(3 * s.replays.max_nonces):  # anyone can make these: the MAC is a public checksum
        assert not refused(exchange(s.port, encode(PUBLIC, REQUEST, ASK)))
    assert len(s.replays._seen) == 0
    assert request("127.0.0.1", s.port, ASK, PUBLIC) == {"ok": True, "held": True}  # the decoder still gets in
    stale = encode(PUBLIC, REQUEST, ASK)
    stale = stale[:24] + (b"\0" * 8) + stale[32:]  # timestamp 0.0: the window still holds without a secret
    assert refused(exchange(s.port, stale))


def test_with_a_secret_only_verified_messages_are_recorded(serve):
    s = serve(KEYS)
    for keys in (PUBLIC, WRONG):
        for _ in range(2 * s.replays.max_nonces):
            assert refused(exchange(s.port, encode(keys, REQUEST, ASK)))
    assert len(s.replays._seen) == 0 and s.refused_total == 4 * s.replays.max_nonces
    frame = encode(KEYS, REQUEST, ASK)
    assert not refused(exchange(s.port, frame)) and len(s.replays._seen) == 1
    assert refused(exchange(s.port, frame))  # a replay of a member's message is still refused


def test_a_peers_refusal_text_is_escaped_and_cut_short(serve, caplog):
    s = serve(KEYS, handler=lambda msg: {"ok": False, "error": FORGED_LOG + "x" * 5000})
    reply = parse_lease_reply(request("127.0.0.1", s.port, ASK, KEYS))
    assert "\n" not in reply.error and "\x1b" not in reply.error and "\x07" not in reply.error
    assert reply.error.startswith("incompatible\\n2099") and len(reply.error) <= MAX_PEER_TEXT + 3

    done = []
    io = PeerIO(lambda: done.append(1), KEYS, renew_every_s=10)
    try:
        with caplog.at_level(logging.INFO):
            io.handshake("e1", "127.0.0.1", s.port, HandshakeRequest("0" * 64, "me"))
            for _ in range(200):
                if results := io.results():
                    break
                time.sleep(0.01)
    finally:
        io.stop()
    (result,) = results
    assert result.kind is ResultKind.HANDSHAKE and not result.ok and "\n" not in result.error
    assert "ERROR hybridkv" in result.error and len(result.error) <= MAX_PEER_TEXT + 3
    assert all("\n" not in r.getMessage() and "\x1b" not in r.getMessage() for r in caplog.records)
