"""vLLM's Grafana dashboards against real servers: every series their panels query (names read from the
dashboards' PromQL into `vllm_dashboard_series.json`, with the commit they came from) is on /metrics, with the
labels the queries select on: the NIXL rows on a PD decoder that read KV, the offload (both connectors' names) and
block-residency rows on a server with a CPU tier that stored, evicted and loaded, the rest on a plain one. The
multimodal-cache series read zero (no multimodal inputs here)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.metrics_util import parse
from tests.procs import Process

SERIES = json.loads((Path(__file__).parent / "vllm_dashboard_series.json").read_text())["dashboards"]


def family(series: str) -> str:
    """The sample name a scraper sees for `series` (histogram parts and counters keep their suffix)."""
    return series.removeprefix("vllm:")


@pytest.fixture(scope="module")
def samples(url) -> dict[str, float]:
    """/metrics after traffic: completions with a shared prefix (hits), n=2 (request_params_n)."""
    for _ in range(2):
        body = {"prompt": "the quick brown fox jumps over the lazy dog " * 6, "max_tokens": 4, "n": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def present(samples: dict[str, float], series: str) -> bool:
    return any(key == series or key.startswith(series + "{") for key in samples)


ROWS = {"nixl_": "pd", "kv_offload_": "offload", "kv_block_": "offload", "simple_kv_offload_": "offload"}


@pytest.fixture(scope="module")
def pd_samples() -> dict[str, float]:
    """A PD decoder's /metrics after it read one prompt's KV from a prefill instance."""
    from tests.pd.pd_util import complete, prefill_only, server
    from tests.procs import together

    p, d = together(server(str(DEFAULT_MODEL_DIR), wait=False), server(str(DEFAULT_MODEL_DIR), wait=False))
    try:
        prompt = "the quick brown fox jumps over the lazy dog " * 6
        out = complete(d.url, prompt, kv_transfer_params=prefill_only(p, prompt))
        assert out["choices"][0]["text"]
        samples = parse(httpx.get(f"{d.url}/metrics", timeout=10).text)
        assert samples["vllm:nixl_xfer_time_seconds_count"] == 1, samples  # the read happened
        assert samples["vllm:nixl_bytes_transferred_sum"] == samples["hybridkv_kv_transfer_bytes_total"] > 0
        return samples
    finally:
        p.stop()
        d.stop()


@pytest.fixture(scope="module")
def offload_samples() -> dict[str, float]:
    """/metrics of a server with a CPU offload tier after a prompt was stored, evicted from the device and loaded;
    it samples every cached block's residency (--kv-cache-metrics)."""
    server = Process("serve", "--threads", "1", "--kv-cache-memory", "3MiB", "--max-model-len", "512",
                     "--kv-offload-cpu", "16MiB", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1")  # fmt: skip
    try:
        # 400-500 tokens each in a 1536-token cache: the first is evicted from the device, the last loads it back
        prompts = [f"{w} " * n for w, n in (("river", 90), ("stone", 90), ("cloud", 110), ("lamp", 150), ("river", 90))]
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
        samples = parse(httpx.get(f"{server.url}/metrics", timeout=10).text)
        assert samples["vllm:kv_offload_load_bytes_total"] > 0, samples  # a load happened
        assert samples["vllm:kv_offload_load_size_count"] >= 1 and samples["vllm:kv_offload_store_size_count"] >= 1
        assert samples["vllm:kv_offload_lookup_sync_delay_seconds_count"] >= 1
        assert samples["vllm:kv_block_lifetime_seconds_count"] >= 1  # blocks were evicted
        return samples
    finally:
        server.stop()


@pytest.mark.parametrize("dashboard", ["vllm-main", "vllm-kv-cache"])
def test_every_series_a_dashboard_queries_is_exported(samples, pd_samples, offload_samples, dashboard):
    panels = SERIES[dashboard]["panels"]
    wanted = sorted({s for names in panels.values() for s in names})
    sources = {"pd": pd_samples, "offload": offload_samples}

    def fed(series: str) -> dict[str, float]:
        return next((sources[k] for prefix, k in ROWS.items() if family(series).startswith(prefix)), samples)

    missing = [s for s in wanted if not present(fed(s), s)]
    assert not missing, missing


def test_labels_the_queries_select_on(samples):
    for stage in ("waiting_to_start", "in_progress", "completed_waiting"):
        assert f'vllm:num_requests_kv_fetch_by_stage{{stage="{stage}"}}' in samples
    for reason in ("capacity", "deferred"):
        assert f'vllm:num_requests_waiting_by_reason{{reason="{reason}"}}' in samples
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert f'vllm:prompt_tokens_by_source_total{{source="{source}"}}' in samples
    assert samples['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] > 0  # the repeated prefix hit
    assert (
        samples["vllm:prompt_tokens_cached_total"]
        == samples['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}']
    )
    assert samples['vllm:request_params_n_bucket{le="2.0"}'] == samples["vllm:request_params_n_count"] == 2
    assert samples["vllm:iteration_tokens_total_count"] > 0
    info = [k for k in samples if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'prefix_caching_hash_algo="hybridkv"' in info[0]
