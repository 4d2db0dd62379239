"""The proxy's own routes, in-process, against instances that are down (and one plain server)."""

import json

import pytest
from fastapi.testclient import TestClient

from hybridkv.serve.proxy import build_proxy
from tests.procs import free_port


def test_urls_are_checked_at_start_up():
    with pytest.raises(ValueError, match="is not a URL"):
        build_proxy(["foo"], ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="at least one"):
        build_proxy([], ["http://127.0.0.1:1"])


def test_health_and_models_report_instances_that_are_down():
    down = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_proxy([down], [down])) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["down"] == [down, down]
        r = client.get("/v1/models")
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "hi"})  # no prefill answers, then no decoder either
        assert r.status_code == 502 and "decode" in r.json()["error"]["message"]


def test_the_proxy_takes_json_only_and_on_loopback_only_loopback_host_names():
    """A web page must not drive the mesh through the proxy: no cross-origin simple POSTs, no DNS rebinding."""
    down = f"http://127.0.0.1:{free_port()}"
    app = build_proxy([down], [down], bind_host="127.0.0.1")
    with TestClient(app, base_url="http://127.0.0.1:8192") as client:
        for headers in ({"content-type": "text/plain"}, {}):
            r = client.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
            assert r.status_code == 415, headers
        assert client.post("/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
        for host in ("evil.example", "evil.example:8192", "10.0.0.1"):
            assert client.get("/health", headers={"host": host}).status_code == 421, host
        for host in ("localhost:8192", "127.0.0.1", "[::1]:8192"):
            assert client.get("/health", headers={"host": host}).status_code == 503, host  # passed the guard
    with TestClient(build_proxy([down], [down], bind_host="0.0.0.0")) as client:  # an operator who exposes it
        assert client.get("/health", headers={"host": "kv.example.com"}).status_code == 503


def test_with_every_prefill_instance_down_the_decoder_serves_alone():
    """Not a 502 for every request: a decoder can compute the prompt itself (counted, and /health says degraded)."""
    from hybridkv import LLM, SamplingParams
    from tests.procs import Process

    downs = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    decoder = Process("serve", "--threads", "1", "--kv-cache-memory", "16MiB", "--max-model-len", "512")
    try:
        with TestClient(build_proxy(downs, [decoder.url], read_timeout_s=30)) as client:
            body = {"prompt": "Remember these codes.\n- ant 58\nQ: what is ant?\nA: ant", "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            expected = (
                LLM(kv_cache_memory="16MiB", max_model_len=512)
                .generate(body["prompt"], SamplingParams(max_tokens=4, temperature=0))[0]
                .outputs[0]
                .text
            )
            for stream in (False, True):
                r = client.post("/v1/completions", json=body | {"stream": stream})
                assert r.status_code == 200
                text = (
                    r.json()["choices"][0]["text"]
                    if not stream
                    else "".join(
                        json.loads(line[6:])["choices"][0]["text"]
                        for line in r.text.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]
                    )
                )
                assert text == expected
            metrics = client.get("/metrics").text
            assert "hybridkv_proxy_prefill_fallbacks_total 2" in metrics  # two requests, each tried both
            assert "hybridkv_proxy_prefill_retries_total 2" in metrics
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert health.json()["degraded_pools"] == ["prefill"] and health.json()["down"] == downs
    finally:
        decoder.stop()


def test_timeouts_are_checked():
    with pytest.raises(ValueError, match="timeouts must be positive"):
        build_proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], read_timeout_s=0)
