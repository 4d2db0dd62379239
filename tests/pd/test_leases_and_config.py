"""Leases, the kv_transfer_config surface and the side channel, without NIXL."""

import socket
import time

import pytest

from hybridkv.connectors.base import KVTransferConfig
from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd.leases import LeaseTable
from hybridkv.connectors.pd.side_channel import request
from hybridkv.connectors.pd.side_channel_server import SideChannelServer

KEYS = MeshKeys.derive(None)
SIG_A, SIG_B = "a" * 64, "b" * 64


def test_a_release_is_trusted_only_while_the_lease_is_held():
    leases = LeaseTable(duration_s=0.2)
    a, b = leases.new_id(), leases.new_id()
    leases.grant(a, "req-a", SIG_A)
    leases.grant(b, "req-b", SIG_B)
    assert leases.renew(a, SIG_A) and leases.release(a, SIG_A)
    assert not leases.release(a, SIG_A)  # twice: the second reader must not trust anything
    time.sleep(0.25)
    assert not leases.renew(b, SIG_B) and not leases.release(b, SIG_B)  # expired
    assert sorted(leases.collect()) == ["req-a", "req-b"] and leases.collect() == []
    assert leases.expired_total == 0 and leases.released_total == 2  # b was marked by its failed release


def test_expired_leases_are_collected_once_and_counted():
    leases = LeaseTable(duration_s=0.05)
    leases.grant(leases.new_id(), "x", SIG_A)
    assert leases.collect() == [] and 0 <= leases.next_deadline() <= 0.05
    time.sleep(0.06)
    assert leases.collect() == ["x"] and leases.expired_total == 1 and leases.next_deadline() is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"kv_role": "kv_both"}', "needs kv_connector"),
        ('{"kv_connector": "Nope"}', "unknown; known: NixlConnector"),
        ('{"kv_connector": "NixlConnector", "kv_role": "leader"}', "kv_role must be one of"),
        ('{"kv_connector": "NixlConnector", "extra": 1}', "unknown keys: extra"),
    ],
)
def test_bad_kv_transfer_config_is_a_clear_error(value, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(value)


def test_side_channel_answers_and_a_taken_port_is_a_clear_error():
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True, "echo": msg["x"]}, KEYS)
    try:
        assert request("127.0.0.1", server.port, {"x": 7}, KEYS) == {"ok": True, "echo": 7}
        with pytest.raises(ValueError, match="side_channel_port"):
            SideChannelServer("127.0.0.1", server.port, lambda msg: msg, KEYS)
    finally:
        server.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{dead}"):
        request("127.0.0.1", dead, {"x": 1}, KEYS, timeout=1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"side_chanel_port": 5600}, "unknown keys \\['side_chanel_port'\\]"),
        ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of"),
        ({"kv_lease_s": 0}, "must be positive"),
        ({"side_channel_port": "five"}, "kv_connector_extra_config.side_channel_port"),
        ({"side_channel_host": "0.0.0.0"}, "would listen on 0.0.0.0 without a mesh secret"),
        ({"secret_file": "/nonexistent/secret"}, "secret_file /nonexistent/secret"),
    ],
)
def test_bad_nixl_options_are_clear_errors(extra, message, monkeypatch):
    from hybridkv.connectors.base import EngineIdentity, connector_factory

    monkeypatch.delenv("HYBRIDKV_KV_SECRET", raising=False)
    config = KVTransferConfig("NixlConnector", kv_connector_extra_config=extra)
    with pytest.raises(ValueError, match=message):
        connector_factory("NixlConnector")(config, EngineIdentity("e", "model", "float32"))
