"""The PD mesh under attack from the same host, with real processes on loopback and a mesh secret set: each attack
of issue 12 is refused or contained, PD keeps serving, outputs equal one instance, and every instance ends with
no block held and its integrity check passing."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from hybridkv.connectors import side_channel
from hybridkv.connectors.descriptors import compat_hash
from hybridkv.connectors.fingerprint import model_fingerprint
from hybridkv.connectors.mesh_auth import SECRET_ENV, MeshKeys
from hybridkv.connectors.pd_messages import HandshakeRequest, LeaseRequest, Op, parse_handshake_reply
from hybridkv.connectors.side_channel import REPLY, REQUEST, encode, request
from hybridkv.connectors.transfer_params import ParamLimits, parse_transfer_params
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.kv.planner import CacheConfig, plan_kv_cache
from tests.pd.frames import exchange, refused
from tests.pd.pd_util import (
    HELDOUT,
    assert_clean,
    complete,
    kv_state,
    prefill_only,
    proxy,
    server,
    single_instance,
)

MODEL = str(DEFAULT_MODEL_DIR)
SECRET = secrets.token_hex(16)
KEYS, PUBLIC = MeshKeys.derive(SECRET.encode()), MeshKeys.derive(None)
WRONG = MeshKeys.derive(b"a guess at the secret, 16+ bytes")
VICTIM, ATTACKER = HELDOUT[50]["prompt"], HELDOUT[51]["prompt"]  # different secret codes, same shape


@pytest.fixture(scope="module")
def mesh():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET)
        p, d = server(MODEL, kv_transfer_timeout_s=5), server(MODEL)  # p: a lease lives at most 2*3+5 s
        x = proxy(p, d)
        yield p, d, x
        for proc in (x, p, d):
            proc.stop()


@pytest.fixture(scope="module")
def single():
    prompts = [VICTIM, ATTACKER, *(it["prompt"] for it in HELDOUT[52:60])]
    return dict(zip(prompts, single_instance(MODEL, prompts)))


def channel(p) -> int:
    return json.loads(p.proc.args[p.proc.args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "side_channel_port"
    ]


def stats(p) -> dict:
    return kv_state(p)["connector"]


def text(out: dict) -> str:
    assert "choices" in out, out
    return out["choices"][0]["text"]


def compat_of(model: str) -> str:
    kv = model_kv_from_hf(load_hf_config(model), block_size=16, dtype="float32")
    plan = plan_kv_cache(kv, CacheConfig(32 << 20, 512))
    return compat_hash(plan, model_fingerprint(model), "float32")


def resign(params: dict, keys: MeshKeys, **changes) -> dict:
    """`params` changed and signed again with `keys` (PUBLIC: what anyone can compute without the secret)."""
    typed = parse_transfer_params(params, ParamLimits(len(params["remote_block_ids"]), 64, 512))
    return replace(typed, **changes).signed(keys.params).to_json()


def through_proxy(x, prompts: list[str], single: dict) -> None:
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: complete(x.url, q), prompts))
    assert [text(o) for o in outs] == [single[q] for q in prompts]


def test_an_outsider_learns_nothing_from_the_side_channel(mesh):
    """The handshake hash oracle and the unauthenticated metadata fetch: one generic refusal, whatever is asked."""
    p, d, _ = mesh
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


def test_nixl_metadata_goes_only_to_mesh_members_encrypted_and_a_replay_gets_nothing(mesh):
    """The raw NIXL read needs the agent metadata: outsiders are refused (above), a sniffer sees it encrypted,
    and replaying a member's captured handshake gets a refusal."""
    p, _, _ = mesh
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


def test_forged_and_swapped_block_ids_never_read_another_requests_kv(mesh, single):
    p, d, x = mesh
    victim, attacker = prefill_only(p, VICTIM), prefill_only(p, ATTACKER)
    before = stats(d)
    swapped = attacker | {"remote_block_ids": victim["remote_block_ids"]}  # the signature no longer matches
    public = resign(attacker, PUBLIC, block_ids=tuple(map(tuple, victim["remote_block_ids"])))  # forged checksum
    for params in (swapped, public):
        assert text(complete(d.url, ATTACKER, kv_transfer_params=params)) == single[ATTACKER]
    after = stats(d)
    assert after["kv_transfer_params_refused_total"] - before["kv_transfer_params_refused_total"] == 2
    assert after["kv_transfer_reads"] == before["kv_transfer_reads"]  # nothing was read for them
    # The victim's own params still work, and what the decoder cached answers each prompt its own code.
    assert text(complete(d.url, VICTIM, kv_transfer_params=victim)) == single[VICTIM]
    assert text(complete(d.url, ATTACKER, kv_transfer_params=attacker)) == single[ATTACKER]
    final = stats(d)
    assert (
        final["kv_transfer_reads"] - after["kv_transfer_reads"] == 2
        and final["kv_transfer_failures"] == (before["kv_transfer_failures"])
    )
    through_proxy(x, [VICTIM, ATTACKER], single)
    assert_clean(p, d)


class Relay:
    """A TCP relay to a side channel that alters one byte of every reply, counting its connections."""

    def __init__(self, target: int) -> None:
        self.target, self.connections = target, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn, socket.create_connection(("127.0.0.1", self.target)) as up:
                head, _, _, tag, payload = side_channel.read_frame(conn, time.monotonic() + 5, REQUEST)
                up.sendall(head + tag + payload)
                rhead, _, _, rtag, rpayload = side_channel.read_frame(up, time.monotonic() + 5, REPLY)
                conn.sendall(rhead + rtag + rpayload[:-1] + bytes([rpayload[-1] ^ 1]))


def test_params_cannot_redirect_a_known_engine_and_a_tampering_relay_fails_its_handshake(mesh, single):
    p, d, x = mesh
    through_proxy(x, [HELDOUT[52]["prompt"]], single)  # the decoder knows p's engine now
    relay = Relay(channel(p))
    try:
        before = stats(d)
        params = prefill_only(p, ATTACKER)
        redirected = params | {"remote_port": relay.port}  # unsigned change
        member = resign(params, KEYS, port=relay.port)  # even signed: the engine proved itself elsewhere
        for forged in (redirected, member):
            assert text(complete(d.url, ATTACKER, kv_transfer_params=forged)) == single[ATTACKER]
        assert relay.connections == 0  # refused before contacting anyone
        stranger = resign(prefill_only(p, VICTIM), KEYS, port=relay.port, engine_id="unknown-engine")
        assert text(complete(d.url, VICTIM, kv_transfer_params=stranger)) == single[VICTIM]
        assert relay.connections >= 1  # a handshake went through it; its altered reply did not authenticate
        after = stats(d)
        assert after["kv_transfer_reads"] == before["kv_transfer_reads"]
        assert after["kv_transfer_failures"] - before["kv_transfer_failures"] == 2  # the signed ones
        assert after["kv_transfer_params_refused_total"] - before["kv_transfer_params_refused_total"] == 1
        through_proxy(x, [HELDOUT[53]["prompt"]], single)
        assert stats(d)["kv_transfer_reads"] > after["kv_transfer_reads"]  # PD goes on: p is still known at p
        assert_clean(p, d)
    finally:
        relay.sock.close()


def deep_json_peer() -> side_channel.SideChannelServer:
    """A mesh member (it has the secret) that answers every request with JSON nested 200 deep."""
    nested = json.loads("[" * 200 + "]" * 200)
    return side_channel.SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "x": nested}, KEYS)


def test_a_bad_port_or_a_deep_json_peer_never_wedges_pd(mesh, single):
    p, d, x = mesh
    params = prefill_only(p, ATTACKER)
    prompts = [it["prompt"] for it in HELDOUT[54:58]]
    with ThreadPoolExecutor(5) as pool:
        others = pool.submit(through_proxy, x, prompts, single)
        bad = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
            "prompt": ATTACKER, "max_tokens": 4, "kv_transfer_params": params | {"remote_port": 2**63}})  # fmt: skip
        others.result()
    assert bad.status_code == 400 and "remote_port" in bad.json()["error"]["message"]
    peer = deep_json_peer()
    try:
        before = stats(d)
        deep = resign(prefill_only(p, VICTIM), KEYS, port=peer.port, engine_id="deep-json-peer")
        assert text(complete(d.url, VICTIM, kv_transfer_params=deep)) == single[VICTIM]
        assert stats(d)["kv_transfer_failures"] - before["kv_transfer_failures"] == 1
    finally:
        peer.close()
    through_proxy(x, [HELDOUT[58]["prompt"]], single)
    assert stats(d)["kv_transfer_reads"] > before["kv_transfer_reads"]  # PD still moves KV
    assert httpx.get(f"{d.url}/health").status_code == 200
    assert_clean(p, d)


def test_lease_ids_cannot_be_guessed_and_leases_cannot_be_pinned(mesh, single):
    p, d, x = mesh
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
        work = pool.submit(through_proxy, x, [it["prompt"] for it in HELDOUT[54:58]], single)
        for guess in guesses:  # even a mesh member cannot name a lease it was not given
            assert ask(Op.RELEASE, guess, signature) == {"ok": True, "held": False}
        assert ask(Op.RELEASE, lease, "0" * 64) == {"ok": True, "held": False}  # the id without its params
        with pytest.raises(ConnectionError, match="refused"):
            ask(Op.RELEASE, lease, signature, PUBLIC)  # the real id and signature, without the secret
        work.result()
        assert 9 < pinned.result() < 12.5
    assert_clean(p, d, timeout=3)


def test_a_slowloris_on_the_side_channel_does_not_stall_pd(mesh, single):
    p, d, x = mesh
    stop, cut = threading.Event(), []

    def slowloris() -> None:  # 30 connections, a byte a second each, reopened as the server cuts them
        conns: list[socket.socket] = []
        while not stop.is_set():
            while len(conns) < 30:
                conns.append(socket.create_connection(("127.0.0.1", channel(p))))
            for c in list(conns):
                try:
                    c.send(b"H")
                except OSError:
                    cut.append(c)
                    conns.remove(c)
            stop.wait(1.0)
        for c in conns:
            c.close()

    attacker = threading.Thread(target=slowloris)
    attacker.start()
    try:
        time.sleep(1)
        before = stats(d)
        prompts = [it["prompt"] for it in HELDOUT[52:60]]
        start = time.monotonic()
        through_proxy(x, prompts, single)
        assert time.monotonic() - start < 20  # 8 requests, 4 at a time: no 5 s stalls
        after = stats(d)
        assert after["kv_transfer_reads"] - before["kv_transfer_reads"] >= 6
        assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
        time.sleep(side_channel.CONNECTION_DEADLINE_S + 1.5)
        assert cut  # the server cut slow connections at their deadline
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


def test_nothing_listens_beyond_the_addresses_the_operator_asked_for(mesh):
    for proc in mesh[:2]:
        sockets = listening(proc.proc.pid)
        ports = {port for _, _, port in sockets}
        assert {proc.port, channel(proc)} <= ports and len(sockets) >= 3, sockets  # HTTP, side channel, UCX
        assert {host for _, host, _ in sockets} <= {"127.0.0.1", "::1"}, sockets


def test_a_model_with_one_changed_tensor_is_another_model(mesh, single, tmp_path):
    """Same shapes, same file sizes, one weight changed far from where the old sampler read: refused."""
    _, d, _ = mesh
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (changed / f.name).write_bytes(f.read_bytes())
    weights = changed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    sampled = (0, len(data) // 2, len(data))  # where the old fingerprint read 64 KiB
    at = next(
        at
        for name, info in header.items()
        if "k_proj" in name
        for at in [8 + header_len + (info["data_offsets"][0] + info["data_offsets"][1]) // 2]
        if min(abs(at - s) for s in sampled) > 100_000
    )
    data[at] ^= 0x10
    weights.write_bytes(bytes(data))
    assert model_fingerprint(changed) != model_fingerprint(DEFAULT_MODEL_DIR)
    other = server(str(changed))
    try:
        params = prefill_only(other, VICTIM)
        before = stats(d)
        assert text(complete(d.url, VICTIM, kv_transfer_params=params)) == single[VICTIM]  # its own weights
        after = stats(d)
        assert after["kv_transfer_reads"] == before["kv_transfer_reads"]
        assert after["kv_transfer_failures"] - before["kv_transfer_failures"] == 1
        assert "refused a handshake: incompatible KV" in other.output()
        assert_clean(other, d)
    finally:
        other.stop()
