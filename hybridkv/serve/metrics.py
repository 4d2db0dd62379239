"""/metrics through `prometheus_client`, under vLLM's names, labels and buckets where vLLM has the metric, so its
Grafana dashboards, autoscalers (KEDA) and endpoint pickers (llm-d, the Gateway API inference extension) read us
unchanged; `hybridkv_*` for what only we have (per-group and state blocks, connector and offload counters).

Two sources, both safe to read from the event loop while the engine thread steps:
- the last `EngineStats` snapshot the engine thread published (gauges and cumulative counters: a collector turns
  it into metric families at scrape time, so a scrape never reads the scheduler's or the pool's live tables);
- per-request histograms and the finish-reason counter, observed on the engine thread when a request's tokens are
  handed to its stream (`prometheus_client` metrics are thread-safe).

Every sample carries vLLM's labels `model_name` (the served name) and `engine` ("0": one engine per server).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.connectors.base import FETCH_STAGES
from hybridkv.engine.stats import EngineStats
from hybridkv.request.state import Request

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine

LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


REVEALING = ("prefix_cache", "hit", "cached", "by_source", "kv_computed", "iteration_tokens")


def reveals_hits(name: str) -> bool:
    """Whether a series tells its reader that some prompt hit a cache (a prefix oracle across tenants): hit and
    cached-token counts, and the computed-token counts a hit lowers (per request, per step)."""
    return any(word in name for word in REVEALING)


class _Snapshot(Collector):
    """The engine thread's last published EngineStats as metric families, built at scrape time."""

    def __init__(self, labels: tuple[str, str], cache_info: dict[str, str]) -> None:
        self.labels = list(labels)
        self.stats = EngineStats()
        self.hide_prefix_hits = False
        self.cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            if not (self.hide_prefix_hits and reveals_hits(family.name)):
                yield family

    def _families(self) -> Iterator[Metric]:
        s, labels = self.stats, self.labels
        total = s.blocks_used + s.blocks_free

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def by(name: str, doc: str, label: str, values: dict[str, float], kind=CounterMetricFamily) -> Metric:
            family = kind(name, doc, labels=[*LABELS, label])
            for key, value in values.items():
                family.add_metric([*labels, key], value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
        # capacity: waiting for blocks or a batch slot; deferred: holding blocks while a connector loads their KV.
        yield by("vllm:num_requests_waiting_by_reason", "Requests waiting, by reason.", "reason",
                 {"capacity": s.waiting, "deferred": s.waiting_for_kv}, GaugeMetricFamily)  # fmt: skip
        stages = {stage: s.kv_fetch_stages.get(stage, 0) for stage in FETCH_STAGES}
        yield by("vllm:num_requests_kv_fetch_by_stage", "Requests loading KV through a connector, by stage.",
                 "stage", stages, GaugeMetricFamily)  # fmt: skip
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                                 labels=[*LABELS, *self.cache_info])  # fmt: skip
        info.add_metric([*labels, *self.cache_info.values()], 1.0)
        yield info
        cached = s.prompt_local_hit_tokens + s.external_hit_tokens
        yield counter("vllm:prompt_tokens_cached", "Prompt tokens whose KV was cached or loaded, not computed.", cached)
        sources = {"local_compute": s.prompt_tokens - cached, "local_cache_hit": s.prompt_local_hit_tokens,
                   "external_kv_transfer": s.external_hit_tokens}  # fmt: skip
        yield by("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.", "source", sources)
        cached_by = {k: v for k, v in sources.items() if k != "local_compute"}
        yield by("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by source.", "source", cached_by)
        yield counter("vllm:external_prefix_cache_queries", "Prompt tokens asked of a KV connector.",
                      s.external_query_tokens)  # fmt: skip
        yield counter("vllm:external_prefix_cache_hits", "Prompt tokens a KV connector had.", s.external_hit_tokens)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.blocks_used / total if total else 0.0)  # fmt: skip
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", s.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", s.prefix_hit_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield gauge("hybridkv_requests_waiting_for_kv", "Requests whose blocks a connector is loading.",
                    s.waiting_for_kv)  # fmt: skip
        yield gauge("hybridkv_kv_blocks_used", "KV blocks held, all groups.", s.blocks_used)
        yield gauge("hybridkv_kv_blocks_free", "KV blocks free or evictable, all groups.", s.blocks_free)
        per_group = GaugeMetricFamily("hybridkv_kv_group_blocks_used", "KV blocks held per attention group.",
                                      labels=[*LABELS, "group"])  # fmt: skip
        for group, n in enumerate(s.group_blocks_used):
            per_group.add_metric([*labels, str(group)], n)
        yield per_group
        yield gauge("hybridkv_kv_state_blocks_used", "Blocks the recurrent-state groups hold.", s.state_blocks_used)
        yield gauge("hybridkv_kv_state_checkpoint_bytes", "Bytes of recurrent-state checkpoints published.",
                    s.state_checkpoint_bytes)  # fmt: skip
        yield counter("hybridkv_external_hit_tokens", "Prompt tokens a connector loaded instead of computing.",
                      s.external_hit_tokens)  # fmt: skip
        yield counter("hybridkv_kv_load_failures", "KV loads that failed.", s.kv_load_failures)
        labeled: dict[str, Metric] = {}  # entries 'name{label="value"}': one family per name
        for key, value in sorted(s.connector.items()):
            name, _, label = key.partition("{")
            full = name if name.startswith("vllm:") else f"hybridkv_{name}"
            counts = name.endswith("_total")
            kind, full = (CounterMetricFamily, full.removesuffix("_total")) if counts else (GaugeMetricFamily, full)
            if not label:
                yield (
                    counter(full, "KV connector counter.", value)
                    if counts
                    else gauge(full, "KV connector gauge.", value)
                )
                continue
            label_name, _, label_value = label.rstrip("}").partition("=")
            family = labeled.setdefault(full, kind(full, "KV connector metric.", labels=[*LABELS, label_name]))
            family.add_metric([*labels, label_value.strip('"')], value)
        yield from labeled.values()
        # No multimodal inputs here: vLLM's multimodal cache is never asked (its dashboard reads zero).
        yield counter("vllm:mm_cache_queries", "Multimodal cache queries (none: no multimodal inputs).", 0)
        yield counter("vllm:mm_cache_hits", "Multimodal cache hits (none: no multimodal inputs).", 0)
        for name, (bounds, counts, total) in sorted(s.connector_histograms.items()):
            family = HistogramMetricFamily(name, "KV connector histogram.", labels=LABELS)
            buckets = [(str(b), c) for b, c in zip(bounds, counts)] + [("+Inf", counts[-1])]
            family.add_metric(labels, buckets, total)
            yield family


def cache_info(engine: LLMEngine) -> dict[str, str]:
    """vllm:cache_config_info's labels: the cache config as vLLM names it (values as strings)."""
    c, plan = engine.config, engine.plan
    return {
        "block_size": str(plan.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "gpu_memory_utilization": str(c.gpu_memory_utilization or ""),
        "kv_cache_memory_bytes": str(plan.total_bytes),
        "num_gpu_blocks": str(plan.num_blocks),
        "prefix_caching_hash_algo": c.prefix_caching_hash_algo,
    }


class EngineMetrics:
    """The registry /metrics renders: one per server (tests run several in one process)."""

    def __init__(
        self, model_name: str = "hybridkv", max_model_len: int = 8192, cache_info: dict[str, str] | None = None
    ) -> None:
        """`cache_info`: vllm:cache_config_info's labels (the cache config, as strings)."""
        self.registry = CollectorRegistry(auto_describe=True)
        values = (model_name, "0")
        self._snapshot = _Snapshot(values, dict(cache_info or {}))
        self.registry.register(self._snapshot)

        # Histograms that reveal cache hits live in their own registry, left out with hide_prefix_hits.
        self.revealing = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            registry = self.revealing if reveals_hits(name) else self.registry
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        latency = REQUEST_LATENCY_BUCKETS
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", latency)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting to be scheduled.", latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Time from scheduled to first token.", latency)
        self.decode = histogram("vllm:request_decode_time_seconds", "Time from first token to finish.", latency)
        self.inference = histogram("vllm:request_inference_time_seconds", "Time from scheduled to finish.", latency)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.output_len = histogram("vllm:request_generation_tokens", "Generated tokens per request.", tokens)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.", tokens)
        self.max_generated = histogram("vllm:request_max_num_generation_tokens",
                                       "Most tokens one of a request's sequences generated.", tokens)  # fmt: skip
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", N_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Decode time per output token of a request, in seconds.", ITL_BUCKETS)  # fmt: skip
        self.computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                  "Prompt tokens a request computed (not cached, not loaded).", tokens)  # fmt: skip
        self.iteration = histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                   ITERATION_TOKEN_BUCKETS)  # fmt: skip
        success = Counter("vllm:request_success", "Finished requests, by finish reason.", [*LABELS, "finished_reason"],
                          registry=self.registry)  # fmt: skip
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

    @property
    def hide_prefix_hits(self) -> bool:
        """/metrics leaves out the series that reveal cache hits (`reveals_hits`)."""
        return self._snapshot.hide_prefix_hits

    @hide_prefix_hits.setter
    def hide_prefix_hits(self, hide: bool) -> None:
        self._snapshot.hide_prefix_hits = hide

    def finished(self, req: Request, now: float) -> None:
        """Observe a request that finished (engine thread). Phases it never reached (an error before its first
        token) are left out of their histograms, as vLLM leaves them."""
        self.success[req.status.value].inc()
        self.e2e.observe(now - req.arrival_time)
        self.prompt_len.observe(req.num_prompt_tokens)
        self.output_len.observe(len(req.output_token_ids))
        self.max_tokens.observe(req.params.max_tokens)
        self.max_generated.observe(len(req.output_token_ids))
        if req.params.extra.get("sequence", 0) == 0:  # a request's first sequence stands for it (`serve/fanout`)
            self.params_n.observe(req.params.extra.get("n", 1))
        self.computed.observe(max(0, req.num_prompt_tokens - req.num_cached_tokens))
        if req.scheduled_time is None:
            return
        self.queue.observe(req.scheduled_time - req.arrival_time)
        self.inference.observe(now - req.scheduled_time)
        if req.first_token_time is not None:
            self.prefill.observe(req.first_token_time - req.scheduled_time)
            self.decode.observe(now - req.first_token_time)
            if len(req.output_token_ids) > 1:
                self.tpot.observe((now - req.first_token_time) / (len(req.output_token_ids) - 1))

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text of `stats` (a snapshot the engine thread published) and of the histograms."""
        self._snapshot.stats = stats
        text = generate_latest(self.registry)
        return text if self.hide_prefix_hits else text + generate_latest(self.revealing)
