"""The HTTP surface of a PD instance, in process: what a browser, a client or a proxy may send, and /health when a
connector thread has died."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from hybridkv.connectors.base import KVTransferConfig
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.serve.api import build_app
from hybridkv.serve.async_engine import AsyncEngine
from tests.pd import pd_util  # noqa: F401 (skips without NIXL)

PROMPT = {"prompt": "the quick brown fox " * 6, "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def instance(folder, policy: str = "recompute", kv_cache_memory: str = "8MiB") -> tuple[AsyncEngine, TestClient]:
    extra = {"side_channel_port": 0, "kv_lease_s": 5, "kv_load_failure_policy": policy}
    ktc = KVTransferConfig("NixlConnector", kv_connector_extra_config=extra)
    config = EngineConfig(model=str(folder), kv_cache_memory=kv_cache_memory, max_model_len=256, kv_transfer_config=ktc)
    engine = AsyncEngine(LLMEngine(config))
    return engine, TestClient(build_app(engine, "tiny"))


@pytest.fixture(scope="module")
def pair(tiny_gemma4):
    """A prefill and a decode instance (policy fail), without a mesh secret."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HYBRIDKV_KV_SECRET", raising=False)
        (pe, prefill), (de, decode) = instance(tiny_gemma4), instance(tiny_gemma4, "fail")
    yield prefill, decode, pe, de
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
    prefill = pair[0]
    r = prefill.post("/v1/completions", content=json.dumps(PROMPT), headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    utf8 = {"content-type": "application/json; charset=utf-8"}
    ok = prefill.post("/v1/completions", content=json.dumps(PROMPT), headers=utf8)
    assert ok.status_code == 200


def test_hostile_bodies_and_host_names_are_refused_before_any_route(pair):
    prefill = pair[0]
    json_type = {"content-type": "application/json"}
    for body in (b"[" * 100_000, b'{"prompt": ' + b"9" * 5000 + b"}", b"\xff\xfe"):
        r = prefill.post("/v1/completions", content=body, headers=json_type)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    loop_bound = TestClient(build_app(pair[2], "tiny", bind_host="127.0.0.1"))
    assert loop_bound.get("/health", headers={"host": "127.0.0.1:8000"}).status_code == 200
    r = loop_bound.get("/health", headers={"host": "rebound.example:8000"})
    assert r.status_code == 421 and "loopback" in r.json()["error"]["message"]


def test_a_batch_moves_every_prompts_kv_and_holds_no_lease_after(pair):
    """A completions batch under PD: a lease and params per prompt (per choice, and one top-level object a router
    passes on), the decoder reads every prompt's KV, and its answers equal one instance's."""
    prefill, decode, pe, de = pair
    prompts = [f"{w} " + PROMPT["prompt"] for w in ("one", "two", "three")]
    body = PROMPT | {"prompt": prompts, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    first = prefill.post("/v1/completions", json=body).json()
    per_choice = [c["kv_transfer_params"] for c in first["choices"]]
    assert first["kv_transfer_params"]["batch"] == per_choice and len({p["lease_id"] for p in per_choice}) == 3
    before = de.engine.connector.metrics()
    batch = PROMPT | {"prompt": prompts}
    second = decode.post("/v1/completions", json=batch | {"kv_transfer_params": first["kv_transfer_params"]})
    alone = decode.post("/v1/completions", json=batch).json()
    assert [c["text"] for c in second.json()["choices"]] == [c["text"] for c in alone["choices"]]
    after = de.engine.connector.metrics()
    assert after["kv_transfer_reads_total"] - before["kv_transfer_reads_total"] == 3
    assert after["kv_transfer_failures_total"] == before["kv_transfer_failures_total"]
    deadline = time.monotonic() + 5
    while pe.engine.connector.leases.blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pe.engine.connector.leases) == 0
    two = PROMPT | {"prompt": prompts[:2], "kv_transfer_params": first["kv_transfer_params"]}
    wrong = decode.post("/v1/completions", json=two)
    assert wrong.status_code == 400 and "3 entries for 2 prompts" in wrong.text


def test_leases_hold_at_most_half_the_pool(tiny_gemma4):
    engine, client = instance(tiny_gemma4, kv_cache_memory="1MiB")
    try:
        connector, pool = engine.engine.connector, engine.engine.plan.num_blocks
        issued_params, refused = [], 0
        for i in range(pool):
            out = client.post("/v1/completions", json=PROMPT | {"prompt": f"{i} " + PROMPT["prompt"], "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": True}}).json()  # fmt: skip
            if "kv_transfer_params" not in out:
                refused += 1
                break
            issued_params.append(out["kv_transfer_params"])
        assert refused and connector.metrics()["kv_leases_refused_total"] == 1
        assert 0.4 * pool <= connector.leases.blocks <= 0.5 * pool
        for params in issued_params:
            assert client.post("/kv_transfer/release", json={"kv_transfer_params": params}).json()["released"]
    finally:
        engine.stop()


def test_admin_is_off_unless_asked_and_docs_need_the_key(tiny_gemma4):
    engine, client = instance(tiny_gemma4)
    try:
        assert client.get("/admin/kv").status_code == 404
        guarded = TestClient(build_app(engine, "tiny", api_key="k3y", enable_admin=True))
        for route in ("/admin/kv", "/docs", "/openapi.json"):
            assert guarded.get(route).status_code == 401, route
        assert guarded.get("/metrics").status_code == 200  # open to scrapers, as in vLLM
        scraped = TestClient(build_app(engine, "tiny", api_key="k3y", api_key_metrics=True))
        assert scraped.get("/metrics").status_code == 401
        assert guarded.get("/admin/kv", headers={"authorization": "Bearer k3y"}).json()["integrity"] == "ok"
        assert guarded.get("/health").status_code == 200
    finally:
        engine.stop()


def test_bad_params_are_400s_naming_the_field_and_forged_ones_403_under_fail(pair):
    prefill, decode, _, _ = pair
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
    from hybridkv.connectors.pd.params import ParamLimits, parse_transfer_params

    prefill, decode, _, _ = pair
    params = issued(prefill)
    typed = parse_transfer_params(params, ParamLimits(len(params["remote_block_ids"]), 64, 256))
    remote = replace(typed, host="10.1.2.3").signed(MeshKeys.derive(None).params).to_json()
    r = decode.post("/v1/completions", json=PROMPT | {"kv_transfer_params": remote})
    assert r.status_code == 403 and "only from instances on this host" in r.json()["error"]["message"]


def test_the_release_route_frees_only_params_this_instance_issued(pair):
    prefill, decode, _, _ = pair
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
        server._loop.call_soon_threadsafe(server._loop.stop)  # its loop ends without close() being called
        deadline = time.monotonic() + 5
        while server.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["dead_threads"] == ["KV side channel"]
    finally:
        engine.stop()
