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
