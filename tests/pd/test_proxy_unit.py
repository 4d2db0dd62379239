"""The proxy's own routes, in-process, against instances that are down: no servers started."""

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
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502 and "prefill instance" in r.json()["error"]["message"]


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
