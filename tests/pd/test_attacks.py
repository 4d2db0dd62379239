"""The PD side channel under attack from the same host, with real processes on loopback and a mesh secret set:
probes, the hash oracle, stolen and replayed metadata, lease guessing and pinning, a slowloris, listeners beyond
loopback. Each is refused or contained, PD keeps serving, outputs equal one instance, and every instance ends with
no block held and its integrity check passing."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd import side_channel, side_channel_server
from hybridkv.connectors.pd.protocol import HandshakeRequest, LeaseRequest, Op, parse_handshake_reply
from hybridkv.connectors.pd.side_channel import REQUEST, encode, request
from tests.pd.attack_util import (
    KEYS,
    MODEL,
    PUBLIC,
    VICTIM,
    WRONG,
    channel,
    compat_of,
    stats,
    through_proxy,
)
from tests.pd.frames import exchange, refused
from tests.pd.pd_util import HELDOUT, assert_clean, prefill_only


def test_an_outsider_learns_nothing_from_the_side_channel(secure_mesh):
    """The handshake hash oracle and the unauthenticated metadata fetch: one generic refusal, whatever is asked."""
    p, d, _ = secure_mesh
    params = prefill_only(p, VICTIM)
    engine_id, port = params["remote_engine_id"], channel(p)
    before = stats(p)["kv_side_channel_refused_total"]
    asks = [HandshakeRequest("0" * 64, "intruder").to_json(), HandshakeRequest(compat_of(MODEL), "x").to_json(),
            LeaseRequest(Op.RENEW, params["lease_id"], params["signature"]).to_json(), {"op": "steal"}]  # fmt: skip
    for keys in (PUBLIC, WRONG):
        for ask in asks:
            reply = exchange(port, encode(keys, REQUEST, ask))
            assert refused(reply) and engine_id.encode() not in reply and b"agent_metadata" not in reply
    assert refused(exchange(port, b'{"op": "handshake", "compat": "0"}\n'))  # the old unauthenticated protocol
    assert stats(p)["kv_side_channel_refused_total"] - before == 9
    # A mesh member with the wrong model learns that it is incompatible, not this instance's hash.
    answer = request("127.0.0.1", port, HandshakeRequest("0" * 64, "member").to_json(), KEYS)
    assert answer["ok"] is False and "incompatible KV" in answer["error"]
    assert not any(len(w) >= 32 and all(c in "0123456789abcdef" for c in w) for w in answer["error"].split())
    assert_clean(p, d)


def test_nixl_metadata_goes_only_to_mesh_members_encrypted_and_a_replay_gets_nothing(secure_mesh):
    """The raw NIXL read needs the agent metadata: outsiders are refused (above), a sniffer sees it encrypted,
    and replaying a member's captured handshake gets a refusal."""
    p, _, _ = secure_mesh
    frame = encode(KEYS, REQUEST, HandshakeRequest(compat_of(MODEL), "member-" + secrets.token_hex(4)).to_json())
    sniffed = exchange(channel(p), frame)
    size = side_channel._HEAD.size
    head, tag, payload = sniffed[:size], sniffed[size : side_channel.FRAME_HEADER], sniffed[side_channel.FRAME_HEADER :]
    request_nonce = side_channel._HEAD.unpack(frame[:size])[4]
    assert side_channel.mac_ok(KEYS.channel, tag, head, request_nonce, payload)  # bound to our request
    assert b"agent_metadata" not in payload and b"placement" not in payload
    plain = side_channel.xor_stream(KEYS.cipher, side_channel._HEAD.unpack(head)[4], payload)
    reply = parse_handshake_reply(side_channel.decode_payload(plain))
    assert len(reply.agent_metadata) > 100 and reply.agent_metadata not in sniffed  # a member gets it, sealed
    assert refused(exchange(channel(p), frame))  # the same captured bytes again


def test_lease_ids_cannot_be_guessed_and_leases_cannot_be_pinned(secure_mesh, secure_single):
    p, d, x = secure_mesh
    params = prefill_only(p, VICTIM)
    lease, signature, port = params["lease_id"], params["signature"], channel(p)

    def ask(op: Op, lease_id: str, sig: str, keys: MeshKeys = KEYS) -> dict:
        return request("127.0.0.1", port, LeaseRequest(op, lease_id, sig).to_json(), keys)

    def pin() -> float:  # renew as fast as one likes: the lease still ends max_hold_s (2 * 3 + 5 s) after it began
        start = time.monotonic()
        while ask(Op.RENEW, lease, signature)["held"] and time.monotonic() - start < 20:
            time.sleep(0.25)
        return time.monotonic() - start

    guesses = [secrets.token_hex(16) for _ in range(50)] + [f"{i:032x}" for i in range(50)]
    with ThreadPoolExecutor(2) as pool:
        pinned = pool.submit(pin)
        work = pool.submit(through_proxy, x, [it["prompt"] for it in HELDOUT[54:58]], secure_single)
        for guess in guesses:  # even a mesh member cannot name a lease it was not given
            assert ask(Op.RELEASE, guess, signature) == {"ok": True, "held": False}
        assert ask(Op.RELEASE, lease, "0" * 64) == {"ok": True, "held": False}  # the id without its params
        with pytest.raises(ConnectionError, match="refused"):
            ask(Op.RELEASE, lease, signature, PUBLIC)  # the real id and signature, without the secret
        work.result()
        assert 9 < pinned.result() < 12.5
    assert_clean(p, d, timeout=3)


def test_a_connection_flood_and_a_slowloris_on_the_side_channel_do_not_stall_pd(secure_mesh, secure_single):
    """More idle connections than the server keeps (reopened as it drops them), each dripping a byte a second: mesh
    peers still get through at once, so every transfer happens and none fails."""
    p, d, x = secure_mesh
    stop, cut = threading.Event(), []
    flood = side_channel_server.MAX_CONNECTIONS + 44

    def attack() -> None:
        conns: list[socket.socket] = []
        while not stop.is_set():
            while len(conns) < flood:
                conns.append(socket.create_connection(("127.0.0.1", channel(p))))
            for c in list(conns):
                try:
                    c.send(b"H")
                except OSError:
                    cut.append(c)
                    conns.remove(c)
                    c.close()
            stop.wait(1.0)
        for c in conns:
            c.close()

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        time.sleep(1.5)
        before = stats(d)
        prompts = [it["prompt"] for it in HELDOUT[52:60]]
        start = time.monotonic()
        through_proxy(x, prompts, secure_single)
        assert time.monotonic() - start < 20  # 8 requests, 4 at a time: no 5 s stalls
        after = stats(d)
        assert after["kv_transfer_reads_total"] - before["kv_transfer_reads_total"] >= 6
        assert after["kv_transfer_failures_total"] == before["kv_transfer_failures_total"]
        time.sleep(side_channel_server.CONNECTION_DEADLINE_S + 1.5)
        assert cut and stats(p)["kv_side_channel_busy_total"] > 0  # dropped: the oldest idle ones, and at deadlines
    finally:
        stop.set()
        attacker.join()
    assert_clean(p, d)


def listening(pid: int) -> set[tuple[str, str, int]]:
    """(protocol, address, port) of every inet socket process `pid` listens on (TCP) or has bound (UDP)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{proto}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if inode not in inodes or (proto.startswith("tcp") and state != "0A"):  # 0A: LISTEN
                    continue
                addr, port = local.split(":")
                words = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                packed = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
                host = socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)
                found.add((proto, host, int(port, 16)))
    return found


def test_nothing_listens_beyond_the_addresses_the_operator_asked_for(secure_mesh):
    for proc in secure_mesh[:2]:
        sockets = listening(proc.proc.pid)
        ports = {port for _, _, port in sockets}
        assert {proc.port, channel(proc)} <= ports and len(sockets) >= 3, sockets  # HTTP, side channel, UCX
        assert {host for _, host, _ in sockets} <= {"127.0.0.1", "::1"}, sockets
