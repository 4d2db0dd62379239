"""Prefill/decode test processes on loopback: servers with a NixlConnector, the proxy, and what tests ask them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.metrics_util import scrape
from tests.procs import Process, together

try:
    from hybridkv.connectors.pd.transport import _nixl

    _nixl()
except ValueError:
    pytest.skip("NIXL is not installed (pip install nixl-cu12)", allow_module_level=True)

ENGINE = ["--threads", "1", "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
HELDOUT = [json.loads(line) for line in (DEFAULT_MODEL_DIR / "heldout.jsonl").read_text().splitlines()]
SHORT = ["Remember these codes.\n- ant 58\nQ: what is ant?\nA: ant", "hi"]  # shorter than the 16-token window


def server(model: str, layout: str = "per-layer", *extra: str, wait: bool = True, **options) -> Process:
    """An instance with a NixlConnector (`options`: its extra config); `wait=False`: see `fronted`."""
    config = {"side_channel_port": 0, "kv_lease_s": 3} | options  # 0: a free port at bind (no race)
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": config}
    args = ["--model", model, "--kv-layout", layout, *ENGINE, "--enable-admin", "--kv-transfer-config"]
    return Process("serve", *args, json.dumps(ktc), *extra, wait=wait)


def proxy(prefill: Process, decode: Process, wait: bool = True) -> Process:
    return Process("proxy", "--prefill", prefill.url, "--decode", decode.url, wait=wait)


def fronted(prefill: Process, decode: Process) -> tuple[Process, Process, Process]:
    """(prefill, decode, a proxy in front of them), all healthy: the three start-ups overlap, so pass instances
    started with wait=False (two servers and a proxy one after another take ~11 s on 2 cores, together ~5)."""
    return together(prefill, decode, proxy(prefill, decode, wait=False))


def complete(url: str, prompt: str, max_tokens: int = 12, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def kv_state(p: Process) -> dict:
    return httpx.get(f"{p.url}/admin/kv", timeout=10).json()


def metrics(p: Process) -> dict[str, float]:
    """/metrics as name -> value (see tests/metrics_util.py)."""
    return scrape(p.url)


def transfer_counters(decoder: Process) -> dict[str, float]:
    """What shows that KV moved into `decoder`: its connector's reads, bytes and failures (/admin/kv), and the
    engine's prompt tokens loaded by a connector instead of computed, and its failed loads (/metrics)."""
    c, m = kv_state(decoder)["connector"], metrics(decoder)
    return {
        "reads": c["kv_transfer_reads_total"],
        "bytes": c["kv_transfer_bytes_total"],
        "failures": c["kv_transfer_failures_total"],
        "external_hit_tokens": m["hybridkv_external_hit_tokens_total"],
        "load_failures": m["hybridkv_kv_load_failures_total"],
    }


def check_transfers(delta: dict[str, float], reads: int | None, at_least: int, failures: int) -> None:
    assert delta["failures"] == delta["load_failures"] == failures, delta
    if reads == 0:
        assert delta["reads"] == delta["bytes"] == delta["external_hit_tokens"] == 0, delta
        return
    if reads is not None:
        assert delta["reads"] == reads, delta
    assert delta["reads"] >= at_least, delta
    assert delta["bytes"] > 0 and delta["external_hit_tokens"] >= delta["reads"], delta  # each read loads tokens


@contextmanager
def transfers(decoder: Process, reads: int | None = None, at_least: int = 1, failures: int = 0) -> Iterator[dict]:
    """Checks, around the block, that the KV really moved into `decoder` (outputs alone cannot tell: a request
    whose load failed recomputes to the same text). `reads` exact, else at least `at_least`: as many reads, bytes
    read and prompt tokens loaded instead of computed; `failures` exactly (connector and engine counts). With
    reads=0 nothing was read or loaded. Yields the deltas, filled in when the block ends.

    /metrics shows a snapshot the engine thread publishes when it goes idle: the check waits a little for it,
    then retries for up to 3 s before it fails."""
    before, delta = transfer_counters(decoder), {}
    yield delta
    time.sleep(0.1)
    deadline = time.monotonic() + 3
    while True:
        delta.update({k: v - before[k] for k, v in transfer_counters(decoder).items()})
        try:
            check_transfers(delta, reads, at_least, failures)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def assert_clean(*servers: Process, timeout: float = 10) -> None:
    """Every instance ends with its integrity check passing and no block held (leases released or expired)."""
    for s in servers:
        deadline = time.monotonic() + timeout
        while (state := kv_state(s))["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state["integrity"] == "ok" and state["blocks_used"] == 0, (state, s.output())


def single_instance(model: str, prompts: list[str], max_tokens: int = 12) -> list[str]:
    llm = LLM(model, kv_cache_memory="32MiB", max_model_len=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def prefill_only(p: Process, prompt: str) -> dict:
    r = complete(p.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return r["kv_transfer_params"]
