"""The front a PD deployment puts before its instances (issue 31, attack 7). Our proxy is the safe default: it
answers only loopback Host headers when bound to loopback (no DNS rebinding), routes only generation and model
routes (never /tokenize or /kv_transfer/release), refuses bodies past its limit before reading them, and passes
each client's API key through, so keyed instances stay keyed. vllm-router, hardened as the README says
(loopback, --max-payload-size at the instances' limit), refuses an oversized body without holding it; what it
does not do (Host checks, route filtering, client keys) is why the README keeps it off hosts where untrusted
users browse."""

from __future__ import annotations

import shutil

import httpx
import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.pd_util import server
from tests.procs import Process, free_port, together
from tests.serve.siege import rss_kib

MODEL = str(DEFAULT_MODEL_DIR)
KEY = "front-door-key"
LIMIT = 1 << 20
BODY = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def pair():
    procs = together(*(server(MODEL, "per-layer", "--api-key", KEY, wait=False) for _ in range(2)))
    yield procs
    for p in procs:
        p.stop()


def post(url: str, route: str, body: dict | bytes, **headers: str) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"} | headers
    return httpx.post(url + route, headers=headers, timeout=60, **kw)  # type: ignore[arg-type]


def test_our_proxy_is_a_safe_front(pair):
    prefill, decode = pair
    front = Process("proxy", "--prefill", prefill.url, "--decode", decode.url, "--max-request-bytes", str(LIMIT))
    try:
        key = {"authorization": f"Bearer {KEY}"}
        assert post(front.url, "/v1/completions", BODY, **key).status_code == 200
        assert post(front.url, "/v1/completions", BODY).status_code == 401  # the instances' key holds
        assert post(front.url, "/v1/completions", BODY, host="evil.com", **key).status_code == 421
        for route in ("/tokenize", "/kv_transfer/release"):
            assert post(front.url, route, {"prompt": "hi"}, **key).status_code in (404, 405), route
        before = rss_kib(front.proc.pid)
        big = b'{"prompt": "' + b"x" * (64 << 20) + b'"}'
        assert post(front.url, "/v1/completions", big, **key).status_code == 413
        assert rss_kib(front.proc.pid) < before + 16 * 1024  # refused by its Content-Length: not read
    finally:
        front.stop()


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router is not installed (test extra)")
def test_vllm_router_with_a_payload_limit_refuses_an_oversized_body(pair):
    prefill, decode = pair
    args = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url, "--policy", "round_robin",
            "--host", "127.0.0.1", "--max-payload-size", str(LIMIT), "--prometheus-port", str(free_port())]  # fmt: skip
    router = Process(*args, program=["vllm-router"], timeout=60)
    try:
        before = rss_kib(router.proc.pid)
        big = b'{"prompt": "' + b"x" * (64 << 20) + b'"}'
        assert post(router.url, "/v1/completions", big).status_code == 413
        assert rss_kib(router.proc.pid) < before + 16 * 1024
        # What it does not check, and why the README keeps it off shared hosts: any Host header is served.
        assert post(router.url, "/v1/completions", BODY, host="evil.com").status_code != 421
    finally:
        router.stop()
