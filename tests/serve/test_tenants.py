"""Tenants behind API keys (issue 31's prefix oracle): with several keys, a tenant cannot learn through the
prefix-cache counters (or timing) whether another tenant sent a prompt, because each key's blocks are hashed with
its own salt; `--no-salt-by-api-key` shares the cache again (and the oracle is back: the test can see it);
`--hide-prefix-cache-metrics` takes the hit counters off /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.metrics_util import scrape
from tests.procs import Process

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
SECRET = "the vault code is 4711 and the door code is 0815, remember both. " * 3  # 144 tokens: 2 exact tiles


def serve(folder, *extra: str) -> Process:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    return Process("serve", "--model", str(folder), "--served-model-name", "tiny", "--threads", "1",
                   "--kv-cache-memory", "16MiB", "--max-model-len", "256", *keys, *extra)  # fmt: skip


def ask(p: Process, key: str, prompt: str, salt: str | None = None) -> None:
    body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
    r = httpx.post(f"{p.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text


def hits_after_probe(p: Process, prober: str) -> float:
    """Tenant A sends the secret; `prober` sends it again: the hit tokens the probe added."""
    ask(p, KEYS[0], SECRET)
    before = scrape(p.url)["vllm:prefix_cache_hits_total"]
    ask(p, prober, SECRET)
    return scrape(p.url)["vllm:prefix_cache_hits_total"] - before


@pytest.mark.parametrize("shared", [False, True], ids=["salted-by-key", "shared"])
def test_another_tenant_cannot_hit_a_tenants_prefix_unless_the_cache_is_shared(tiny_gemma4, shared):
    p = serve(tiny_gemma4, *(["--no-salt-by-api-key"] if shared else []))
    try:
        own = hits_after_probe(p, KEYS[0])
        assert own > 0  # the same tenant hits its own prefix
        other = hits_after_probe(p, KEYS[1])
        assert (other > 0) is shared, other
    finally:
        p.stop()


def test_a_client_salt_still_separates_requests_within_one_tenant(tiny_gemma4):
    p = serve(tiny_gemma4)
    try:
        ask(p, KEYS[0], SECRET, salt="a")
        before = scrape(p.url)["vllm:prefix_cache_hits_total"]
        ask(p, KEYS[0], SECRET, salt="b")
        assert scrape(p.url)["vllm:prefix_cache_hits_total"] == before
    finally:
        p.stop()


def test_hidden_prefix_cache_metrics_are_off_the_open_metrics(tiny_gemma4):
    p = serve(tiny_gemma4, "--hide-prefix-cache-metrics")
    try:
        ask(p, KEYS[0], SECRET)
        text = httpx.get(f"{p.url}/metrics", timeout=10).text  # open: no key
        names = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
        assert "vllm:num_requests_running" in names
        assert not [n for n in names if "prefix_cache" in n or "hit" in n], names
    finally:
        p.stop()
