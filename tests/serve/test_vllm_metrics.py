"""/metrics as vLLM's scrapers read it (Grafana dashboards, KEDA, llm-d's endpoint picker): vLLM's names, labels and
buckets through prometheus_client's parser, open without the API key unless --api-key-metrics."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.serve.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, buckets_1_2_5
from tests.metrics_util import parse
from tests.serve.conftest import start_server

KEY = {"authorization": "Bearer s3cret"}
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def bounds(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


def test_vllm_names_labels_and_buckets_open_to_scrapers(folder):
    for url in start_server(folder, "--api-key", "s3cret"):
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key still guards the API
        before = httpx.get(f"{url}/metrics", timeout=10)  # a scraper without the key
        assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
        fams = families(before.text)
        assert {name: fams[name].type for name in VLLM_FAMILIES} == VLLM_FAMILIES
        for f in fams.values():
            for s in f.samples:
                assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", s
        inf = float("inf")
        assert bounds(fams["vllm:time_to_first_token_seconds"]) == [*TTFT_BUCKETS, inf]
        assert bounds(fams["vllm:inter_token_latency_seconds"]) == [*ITL_BUCKETS, inf]
        assert bounds(fams["vllm:e2e_request_latency_seconds"]) == [*REQUEST_LATENCY_BUCKETS, inf]
        assert bounds(fams["vllm:request_prompt_tokens"]) == [*buckets_1_2_5(256), inf] == [1, 2, 5, 10, 20, 50,
                                                                                            100, 200, inf]  # fmt: skip

        body = {"prompt": "count these tokens " * 4, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=KEY, timeout=60)
        assert r.status_code == 200, r.text
        n = r.json()["usage"]["prompt_tokens"]
        m0, m = parse(before.text), parse(httpx.get(f"{url}/metrics", timeout=10).text)
        delta = {k: v - m0.get(k, 0.0) for k, v in m.items()}
        assert delta['vllm:request_success_total{finished_reason="length"}'] == 1
        assert delta['vllm:request_success_total{finished_reason="stop"}'] == 0
        assert delta["vllm:request_prompt_tokens_sum"] == n and delta["vllm:request_generation_tokens_sum"] == 5
        assert delta["vllm:request_params_max_tokens_sum"] == 5
        for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                      "request_inference_time", "time_to_first_token"):  # fmt: skip
            assert delta[f"vllm:{phase}_seconds_count"] == 1, phase
            assert delta[f"vllm:{phase}_seconds_sum"] >= 0, phase
        e2e, parts = delta["vllm:e2e_request_latency_seconds_sum"], delta["vllm:request_queue_time_seconds_sum"]
        assert parts + delta["vllm:request_inference_time_seconds_sum"] <= e2e + 1e-6
        assert 1 <= delta["vllm:inter_token_latency_seconds_count"] <= 4  # tokens 2..5, however they were batched
        time.sleep(0.2)  # the engine thread publishes its gauges and counters when it goes idle
        settled = parse(httpx.get(f"{url}/metrics", timeout=10).text)
        assert settled["vllm:prompt_tokens_total"] - m0["vllm:prompt_tokens_total"] == n
        assert settled["vllm:kv_cache_usage_perc"] == 0.0 and settled["vllm:num_requests_running"] == 0


def test_api_key_metrics_guards_metrics_too(folder):
    for url in start_server(folder, "--api-key", "s3cret", "--api-key-metrics"):
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        ok = httpx.get(f"{url}/metrics", headers=KEY, timeout=10)
        assert ok.status_code == 200 and "vllm:num_requests_waiting" in parse(ok.text)
        assert httpx.get(f"{url}/health").status_code == 200
