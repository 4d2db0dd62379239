"""The HTTP surface of a PD instance, in process: what a browser, a client or a proxy may send, and /health when a
connector thread has died."""

from __future__ import annotations

import json
import socket
import time

import pytest
from fastapi.testclient import TestClient

from hybridkv.connectors.base import KVTransferConfig
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.serve.api import build_app
from hybridkv.serve.async_engine import AsyncEngine
from tests.pd import pd_util  # noqa: F401 (skips without NIXL)
from tests.procs import free_port

PROMPT = {"prompt": "the quick brown fox " * 6, "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def instance(folder, policy: str = "recompute", **app_options) -> tuple[AsyncEngine, TestClient]:
    extra = {"side_channel_port": free_port(), "kv_lease_s": 5, "kv_load_failure_policy": policy}
    ktc = KVTransferConfig("NixlConnector", kv_connector_extra_config=extra)
    config = EngineConfig(model=str(folder), kv_cache_memory="8MiB", max_model_len=256, kv_transfer_config=ktc)
    engine = AsyncEngine(LLMEngine(config))
    return engine, TestClient(build_app(engine, "tiny", **app_options))


@pytest.fixture(scope="module")
def pair(tiny_gemma4):
    """A prefill and a decode instance (policy fail), without a mesh secret."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HYBRIDKV_KV_SECRET", raising=False)
        (pe, prefill), (de, decode) = instance(tiny_gemma4), instance(tiny_gemma4, "fail")
    yield prefill, decode
    pe.stop()
    de.stop()


def issued(prefill: TestClient) -> dict:
    body = PROMPT | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = prefill.post("/v1/completions", json=body)
    return r.json()["kv_transfer_params"]


@pytest.mark.parametrize(
    "headers", [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}]
)
def test_only_json_bodies_are_taken(pair, headers):
    """A web page can POST text/plain or a form cross-origin without a preflight; it cannot send JSON."""
    prefill, _ = pair
    r = prefill.post("/v1/completions", content=json.dumps(PROMPT), headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    utf8 = {"content-type": "application/json; charset=utf-8"}
    ok = prefill.post("/v1/completions", content=json.dumps(PROMPT), headers=utf8)
    assert ok.status_code == 200


def test_admin_is_off_unless_asked_and_docs_need_the_key(tiny_gemma4):
    engine, client = instance(tiny_gemma4)
    try:
        assert client.get("/admin/kv").status_code == 404
        guarded = TestClient(build_app(engine, "tiny", api_key="k3y", enable_admin=True))
        for route in ("/admin/kv", "/docs", "/openapi.json", "/metrics"):
            assert guarded.get(route).status_code == 401, route
        assert guarded.get("/admin/kv", headers={"authorization": "Bearer k3y"}).json()["integrity"] == "ok"
        assert guarded.get("/health").status_code == 200
    finally:
        engine.stop()


def test_bad_params_are_400s_naming_the_field_and_forged_ones_403_under_fail(pair):
    prefill, decode = pair
    params = issued(prefill)
    for field, value in (("remote_port", 2**63), ("remote_block_ids", [["a"]]), ("lease_id", 7)):
        r = decode.post("/v1/completions", json=PROMPT | {"kv_transfer_params": params | {field: value}})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    forged = params | {"remote_block_ids": [[b + 1 for b in g] for g in params["remote_block_ids"]]}
    r = decode.post("/v1/completions", json=PROMPT | {"kv_transfer_params": forged})
    assert r.status_code == 403 and "signature does not verify" in r.json()["error"]["message"]
    r = decode.post("/v1/completions", json=PROMPT | {"stream": True, "kv_transfer_params": forged})
    assert r.status_code == 403  # refused before the stream starts
    good = decode.post("/v1/completions", json=PROMPT | {"kv_transfer_params": params})
    assert good.status_code == 200


def test_without_a_secret_a_decoder_reads_only_from_this_host(pair):
    """Anyone can compute the public signature, so params may name any host: the decoder refuses remote ones."""
    from dataclasses import replace

    from hybridkv.connectors.mesh_auth import MeshKeys
    from hybridkv.connectors.transfer_params import ParamLimits, parse_transfer_params

    prefill, decode = pair
    params = issued(prefill)
    typed = parse_transfer_params(params, ParamLimits(len(params["remote_block_ids"]), 64, 256))
    remote = replace(typed, host="10.1.2.3").signed(MeshKeys.derive(None).params).to_json()
    r = decode.post("/v1/completions", json=PROMPT | {"kv_transfer_params": remote})
    assert r.status_code == 403 and "only from instances on this host" in r.json()["error"]["message"]


def test_the_release_route_frees_only_params_this_instance_issued(pair):
    prefill, decode = pair
    params = issued(prefill)
    assert decode.post("/kv_transfer/release", json={"kv_transfer_params": params}).json() == {"released": False}
    forged = params | {"lease_id": "0" * 32}
    assert prefill.post("/kv_transfer/release", json={"kv_transfer_params": forged}).json() == {"released": False}
    assert prefill.post("/kv_transfer/release", json={"kv_transfer_params": params}).json() == {"released": True}
    assert prefill.post("/kv_transfer/release", json={"kv_transfer_params": params}).json() == {"released": False}
    r = prefill.post("/kv_transfer/release", json={"kv_transfer_params": params | {"remote_port": "x"}})
    assert r.status_code == 400


def test_health_names_a_connector_thread_that_died(tiny_gemma4):
    engine, client = instance(tiny_gemma4)
    try:
        assert client.get("/health").status_code == 200
        server = engine.engine.connector.server
        server.sock.shutdown(socket.SHUT_RDWR)  # the listener breaks without close() being called: its thread ends
        deadline = time.monotonic() + 5
        while server.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["dead_threads"] == ["KV side channel"]
    finally:
        engine.stop()
