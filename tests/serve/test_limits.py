"""What the server refuses, and that refusing one request never changes another: poison values among concurrent
requests, strict fields, unsupported OpenAI fields, lone surrogates, deep JSON, max_tokens past the context, huge
bodies (while /health keeps answering and memory comes back), clients that leave; and the small routes vLLM has
(/v1/models/{id}, /version, /tokenize, /detokenize) and cache_salt."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import hybridkv
from tests.metrics_util import scrape
from tests.procs import Process

NORMAL = [{"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
          for p in ("the quick brown fox", "hello world", "one two three four", "a b c")]  # fmt: skip
VALID_EXTREMES = [{"temperature": 1e-300}, {"top_p": 1e-300, "seed": 3}, {"repetition_penalty": 1e-300, "seed": 4},
                  {"repetition_penalty": 1e300, "temperature": 1e-4, "seed": 5}]  # fmt: skip
BAD_SCHEMA = {"name": "x", "schema": {"type": "no such type"}}
INVALID = [
    ({"max_tokens": True}, "max_tokens"),
    ({"seed": "3"}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": BAD_SCHEMA}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"suffix": "!"}, "suffix"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[10**30]]}}, "kv_transfer_params"),
]


@pytest.fixture(scope="module")
def server(tiny_gemma4):
    engine = ["--threads", "1", "--kv-cache-memory", "16MiB", "--max-model-len", "1024"]
    p = Process("serve", "--model", str(tiny_gemma4), "--served-model-name", "tiny", *engine,
                "--max-request-bytes", str(1 << 20))  # fmt: skip
    yield p
    p.stop()


def post(url: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                      timeout=timeout)  # fmt: skip


def texts(url: str, bodies: list[dict]) -> list[str]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return [r.json()["choices"][0]["text"] for r in pool.map(lambda b: post(url, b), bodies)]


def metric(url: str, name: str) -> float:
    return scrape(url)[name]


@pytest.mark.parametrize("poison", [*VALID_EXTREMES, *(p for p, _ in INVALID)], ids=lambda p: str(p)[:50])
def test_a_poison_request_among_four_changes_nothing_for_them(server, poison):
    alone = texts(server.url, NORMAL)
    bad = NORMAL[0] | poison
    with ThreadPoolExecutor(5) as pool:
        others = pool.submit(texts, server.url, NORMAL)
        answer = post(server.url, bad)
        assert others.result() == alone
    if poison in VALID_EXTREMES:  # inside vLLM's ranges: it must sample sanely, never nan
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) > 0
    else:
        field = next(f for p, f in INVALID if p == poison)
        assert 400 <= answer.status_code < 500 and field in answer.text, answer.text


def test_bodies_that_do_not_parse_as_valid_requests_are_400s(server):
    bodies = [
        (b'{"prompt": "a\\ud800b"}', "surrogate"),
        (b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper"),
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ]
    for raw, why in bodies:
        r = post(server.url, raw)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert post(server.url, NORMAL[0] | {"tools": None}).status_code == 200  # an unset field is no field


def test_max_tokens_past_the_context_is_a_400_and_the_default_shrinks(server):
    prompt = [10 + i % 200 for i in range(1013)]  # 1013 tokens of a 1024-token context: 11 left
    r = post(server.url, {"prompt": prompt, "max_tokens": 12})
    assert r.status_code == 400 and "ask for at most 11" in r.json()["error"]["message"]
    r = post(server.url, {"prompt": prompt, "ignore_eos": True})  # the default 16 does not fit: it shrinks
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 11


def rss(pid: int) -> int:
    return int(next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if "VmRSS" in ln))


PROBE = """
import os, sys, time, httpx
url, stop = sys.argv[1], sys.argv[2]
with httpx.Client(timeout=5) as client:
    client.get(url + "/health")  # warm-up: the first request pays for the client's start
    while not os.path.exists(stop):
        start = time.monotonic()
        assert client.get(url + "/health").status_code == 200
        print(start, time.monotonic() - start, flush=True)
        time.sleep(0.01)
"""


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_huge_body_is_refused_while_health_answers_and_memory_comes_back(server, tmp_path):
    """/health is probed from another process (the sender's own GIL must not be measured), which reports each
    probe's start (CLOCK_MONOTONIC, shared by processes) and latency. No timed window: the bodies go once the
    prober has answered probes, it stops once a probe started after them, and every probe that overlapped
    the sending, or came after it, must have answered within 100 ms."""
    big = b'{"prompt": "' + b"x" * (50 << 20) + b'"}'
    before = rss(server.proc.pid)
    stop = tmp_path / "stop"
    prober = subprocess.Popen([sys.executable, "-c", PROBE, server.url, str(stop)], stdout=subprocess.PIPE, text=True)
    samples: list[tuple[float, float]] = []  # (start, latency) of each probe

    def read() -> None:
        for line in prober.stdout:
            start, latency = map(float, line.split())
            samples.append((start, latency))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(samples) >= 10 or prober.poll() is not None, 60, "the prober's first probes")
        sent = time.monotonic()
        r = post(server.url, big, timeout=120)  # with a Content-Length: refused before it is read
        assert r.status_code == 413 and "at most 1048576" in r.text

        def chunks():
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + (1 << 20)]

        try:  # chunked, no Content-Length: read up to the limit, then refused
            headers = {"content-type": "application/json"}
            r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers, timeout=120)
            assert r.status_code == 413
        except httpx.TransportError:
            pass  # the server answered 413 and closed while we were still sending: refused too
        done = time.monotonic()
        wait_until(lambda: any(s > done for s, _ in samples) or prober.poll() is not None, 60, "a probe after")
    finally:
        stop.touch()
        prober.wait(timeout=30)
        reader.join(timeout=30)
    assert prober.returncode == 0 and len(samples) > 10 and any(s > done for s, _ in samples)
    during = [lat for s, lat in samples if s + lat >= sent]  # overlapping the sending, or after it
    assert during and max(during) < 0.1, sorted(during)[-5:]
    assert rss(server.proc.pid) < before * 1.1 + 4096  # KiB
    assert texts(server.url, NORMAL[:1])


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(server):
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 1000, "ignore_eos": True}).encode()
    generated = metric(server.url, "vllm:generation_tokens_total")
    host, port = "127.0.0.1", server.port
    with socket.create_connection((host, port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 10
        while metric(server.url, "vllm:num_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(server.url, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 5
    while metric(server.url, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server.url, "vllm:num_requests_running") == 0 and metric(server.url, "hybridkv_kv_blocks_used") == 0
    assert metric(server.url, "vllm:generation_tokens_total") - generated < 1000  # stopped, not run to the end


def test_model_version_tokenize_and_detokenize_routes(server):
    url = server.url
    assert httpx.get(f"{url}/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{url}/v1/models/other").status_code == 404
    assert httpx.get(f"{url}/version").json() == {"version": hybridkv.__version__}
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hello world"}]}).json()
    assert chat["count"] >= tok["count"]
    for bad in ({"tokens": [10**9]}, {"tokens": [True]}, {"tokens": "1,2"}):
        assert httpx.post(f"{url}/detokenize", json=bad).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={}).status_code == 400


def test_cache_salt_separates_prefix_caches(server):
    prompt = {"prompt": "a shared system prompt of some length " * 6, "max_tokens": 2, "temperature": 0}

    def hit_tokens(body: dict) -> float:
        before = metric(server.url, "vllm:prefix_cache_hits_total")
        assert post(server.url, body).status_code == 200
        return metric(server.url, "vllm:prefix_cache_hits_total") - before

    hit_tokens(prompt | {"cache_salt": "tenant-a"})
    assert hit_tokens(prompt | {"cache_salt": "tenant-a"}) > 0  # the same tenant reuses its blocks
    assert hit_tokens(prompt | {"cache_salt": "tenant-b"}) == 0  # another tenant shares nothing
    assert hit_tokens(prompt) == 0  # nor does a request without a salt
    assert post(server.url, prompt | {"cache_salt": ""}).status_code == 400
