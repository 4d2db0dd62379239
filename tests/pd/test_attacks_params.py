"""kv_transfer_params and peers under attack, with real processes on loopback and a mesh secret set: forged and
swapped block ids, a redirect and a tampering relay, a bad port, a peer answering deeply nested JSON, a model with
one changed tensor. Each is refused or contained, PD keeps serving, outputs equal one instance, and every instance
ends with no block held and its integrity check passing."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from hybridkv.connectors.identity import model_fingerprint
from hybridkv.connectors.pd import side_channel
from hybridkv.connectors.pd.side_channel import REPLY, REQUEST
from hybridkv.connectors.pd.side_channel_server import SideChannelServer
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.attack_util import (
    ATTACKER,
    KEYS,
    PUBLIC,
    VICTIM,
    channel,
    resign,
    stats,
    text,
    through_proxy,
)
from tests.pd.pd_util import HELDOUT, assert_clean, complete, prefill_only, server


def test_forged_and_swapped_block_ids_never_read_another_requests_kv(secure_mesh, secure_single):
    p, d, x = secure_mesh
    victim, attacker = prefill_only(p, VICTIM), prefill_only(p, ATTACKER)
    before = stats(d)
    swapped = attacker | {"remote_block_ids": victim["remote_block_ids"]}  # the signature no longer matches
    public = resign(attacker, PUBLIC, block_ids=tuple(map(tuple, victim["remote_block_ids"])))  # forged checksum
    for params in (swapped, public):
        assert text(complete(d.url, ATTACKER, kv_transfer_params=params)) == secure_single[ATTACKER]
    after = stats(d)
    assert after["kv_transfer_params_refused_total"] - before["kv_transfer_params_refused_total"] == 2
    assert after["kv_transfer_reads"] == before["kv_transfer_reads"]  # nothing was read for them
    # The victim's own params still work, and what the decoder cached answers each prompt its own code.
    assert text(complete(d.url, VICTIM, kv_transfer_params=victim)) == secure_single[VICTIM]
    assert text(complete(d.url, ATTACKER, kv_transfer_params=attacker)) == secure_single[ATTACKER]
    final = stats(d)
    assert (
        final["kv_transfer_reads"] - after["kv_transfer_reads"] == 2
        and final["kv_transfer_failures"] == (before["kv_transfer_failures"])
    )
    through_proxy(x, [VICTIM, ATTACKER], secure_single)
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


def test_params_cannot_redirect_a_known_engine_and_a_tampering_relay_fails_its_handshake(secure_mesh, secure_single):
    p, d, x = secure_mesh
    through_proxy(x, [HELDOUT[52]["prompt"]], secure_single)  # the decoder knows p's engine now
    relay = Relay(channel(p))
    try:
        before = stats(d)
        params = prefill_only(p, ATTACKER)
        redirected = params | {"remote_port": relay.port}  # unsigned change
        member = resign(params, KEYS, port=relay.port)  # even signed: the engine proved itself elsewhere
        for forged in (redirected, member):
            assert text(complete(d.url, ATTACKER, kv_transfer_params=forged)) == secure_single[ATTACKER]
        assert relay.connections == 0  # refused before contacting anyone
        stranger = resign(prefill_only(p, VICTIM), KEYS, port=relay.port, engine_id="unknown-engine")
        assert text(complete(d.url, VICTIM, kv_transfer_params=stranger)) == secure_single[VICTIM]
        assert relay.connections >= 1  # a handshake went through it; its altered reply did not authenticate
        after = stats(d)
        assert after["kv_transfer_reads"] == before["kv_transfer_reads"]
        assert after["kv_transfer_failures"] - before["kv_transfer_failures"] == 2  # the signed ones
        assert after["kv_transfer_params_refused_total"] - before["kv_transfer_params_refused_total"] == 1
        through_proxy(x, [HELDOUT[53]["prompt"]], secure_single)
        assert stats(d)["kv_transfer_reads"] > after["kv_transfer_reads"]  # PD goes on: p is still known at p
        assert_clean(p, d)
    finally:
        relay.sock.close()


def deep_json_peer() -> SideChannelServer:
    """A mesh member (it has the secret) that answers every request with JSON nested 200 deep."""
    nested = json.loads("[" * 200 + "]" * 200)
    return SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "x": nested}, KEYS)


def test_a_bad_port_or_a_deep_json_peer_never_wedges_pd(secure_mesh, secure_single):
    p, d, x = secure_mesh
    params = prefill_only(p, ATTACKER)
    prompts = [it["prompt"] for it in HELDOUT[54:58]]
    poisons = [("remote_port", 2**63), ("remote_block_ids", [[10**30]] * 2), ("remote_block_ids", [["a"]] * 2),
               ("remote_block_ids", [[1e300]] * 2)]  # fmt: skip
    for field, value in poisons:  # each among four concurrent PD requests, which answer as one instance does
        with ThreadPoolExecutor(5) as pool:
            others = pool.submit(through_proxy, x, prompts, secure_single)
            bad = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
                "prompt": ATTACKER, "max_tokens": 4, "kv_transfer_params": params | {field: value}})  # fmt: skip
            others.result()
        assert bad.status_code == 400 and field in bad.json()["error"]["message"], bad.text
    peer = deep_json_peer()
    try:
        before = stats(d)
        deep = resign(prefill_only(p, VICTIM), KEYS, port=peer.port, engine_id="deep-json-peer")
        assert text(complete(d.url, VICTIM, kv_transfer_params=deep)) == secure_single[VICTIM]
        assert stats(d)["kv_transfer_failures"] - before["kv_transfer_failures"] == 1
    finally:
        peer.close()
    through_proxy(x, [HELDOUT[58]["prompt"]], secure_single)
    assert stats(d)["kv_transfer_reads"] > before["kv_transfer_reads"]  # PD still moves KV
    assert httpx.get(f"{d.url}/health").status_code == 200
    assert_clean(p, d)


def test_a_model_with_one_changed_tensor_is_another_model(secure_mesh, secure_single, tmp_path):
    """Same shapes, same file sizes, one weight changed far from where the old sampler read: refused."""
    _, d, _ = secure_mesh
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
        assert text(complete(d.url, VICTIM, kv_transfer_params=params)) == secure_single[VICTIM]  # its own weights
        after = stats(d)
        assert after["kv_transfer_reads"] == before["kv_transfer_reads"]
        assert after["kv_transfer_failures"] - before["kv_transfer_failures"] == 1
        assert "refused a handshake: incompatible KV" in other.output()
        assert_clean(other, d)
    finally:
        other.stop()
