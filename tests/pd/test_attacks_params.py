"""kv_transfer_params and peers under attack, with real processes on loopback and a mesh secret set: forged and
swapped block ids, a redirect and a tampering relay, a bad port, a peer answering deeply nested JSON, a model with
one changed tensor. Each is refused or contained, PD keeps serving, outputs equal one instance, and every instance
ends with no block held and its integrity check passing."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
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
    one_request,
    resign,
    stats,
    text,
    through_proxy,
)
from tests.pd.pd_util import HELDOUT, assert_clean, complete, prefill_only, server


def test_forged_and_swapped_block_ids_never_read_another_requests_kv(secure_mesh, secure_single):
    """Each request's counters are checked on their own (`one_request`): a genuine read gets fresh params, so a
    loaded machine that lets a lease lapse between issue and use retries instead of miscounting."""
    p, d, x = secure_mesh
    victim, attacker = prefill_only(p, VICTIM), prefill_only(p, ATTACKER)
    assert victim["remote_block_ids"] != attacker["remote_block_ids"]  # or the swap below would change nothing
    swapped = attacker | {"remote_block_ids": victim["remote_block_ids"]}  # the signature no longer matches
    public = resign(attacker, PUBLIC, block_ids=tuple(map(tuple, victim["remote_block_ids"])))  # forged checksum
    for forged in (swapped, public):  # refused by signature, however late: nothing is read for them
        out, delta = one_request(d, lambda f=forged: f, lambda f: complete(d.url, ATTACKER, kv_transfer_params=f))
        assert text(out) == secure_single[ATTACKER] and delta == {"refused": 1, "failures": 0, "reads": 0}, delta
    # The victim's own params still work, and what the decoder cached answers each prompt its own code.
    for prompt in (VICTIM, ATTACKER):
        out, delta = one_request(
            d, lambda q=prompt: prefill_only(p, q), lambda f, q=prompt: complete(d.url, q, kv_transfer_params=f),
            reads=1,
        )  # fmt: skip
        assert text(out) == secure_single[prompt] and delta == {"refused": 0, "failures": 0, "reads": 1}, delta
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
    """Each forged request's counters are checked on their own, with params issued just before it (`one_request`):
    stale params on a loaded machine would be refused as expired instead of failing where this test looks."""
    p, d, x = secure_mesh
    through_proxy(x, [HELDOUT[52]["prompt"]], secure_single)  # the decoder knows p's engine now
    relay = Relay(channel(p))
    try:
        before = stats(d)

        def send(prompt: str) -> Callable[[dict], dict]:
            return lambda params: complete(d.url, prompt, kv_transfer_params=params)

        def redirected() -> dict:  # an unsigned change
            return prefill_only(p, ATTACKER) | {"remote_port": relay.port}

        def member() -> dict:  # signed by a mesh member, but the engine proved itself at p
            return resign(prefill_only(p, ATTACKER), KEYS, port=relay.port)

        def stranger() -> dict:  # an engine the decoder does not know, through the tampering relay
            return resign(prefill_only(p, VICTIM), KEYS, port=relay.port, engine_id="unknown-engine")

        out, delta = one_request(d, redirected, send(ATTACKER), refused=1)
        assert text(out) == secure_single[ATTACKER] and delta == {"refused": 1, "failures": 0, "reads": 0}, delta
        out, delta = one_request(d, member, send(ATTACKER), failures=1)
        assert text(out) == secure_single[ATTACKER] and delta == {"refused": 0, "failures": 1, "reads": 0}, delta
        assert relay.connections == 0  # refused before contacting anyone: the engine proved itself at p
        out, delta = one_request(d, stranger, send(VICTIM), failures=1)
        assert text(out) == secure_single[VICTIM] and delta == {"refused": 0, "failures": 1, "reads": 0}, delta
        assert relay.connections >= 1  # a handshake went through it; its altered reply did not authenticate
        after = stats(d)
        assert after["kv_transfer_reads_total"] == before["kv_transfer_reads_total"]
        through_proxy(x, [HELDOUT[53]["prompt"]], secure_single)
        assert (
            stats(d)["kv_transfer_reads_total"] > after["kv_transfer_reads_total"]
        )  # PD goes on: p is still known at p
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
        assert stats(d)["kv_transfer_failures_total"] - before["kv_transfer_failures_total"] == 1
    finally:
        peer.close()
    through_proxy(x, [HELDOUT[58]["prompt"]], secure_single)
    assert stats(d)["kv_transfer_reads_total"] > before["kv_transfer_reads_total"]  # PD still moves KV
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
        assert after["kv_transfer_reads_total"] == before["kv_transfer_reads_total"]
        assert after["kv_transfer_failures_total"] - before["kv_transfer_failures_total"] == 1
        assert "refused a handshake: incompatible KV" in other.output()
        assert_clean(other, d)
    finally:
        other.stop()
