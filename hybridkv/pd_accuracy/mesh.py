"""The processes of one model's sweep: a pool of NixlConnector instances per KV layout (started on first use and
reused by every cell that needs that many of that layout, whether as prefill or decode), the plain instance the
cells are compared with, the routers, and what the instances report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.launch import Process, free_port
from hybridkv.pd_accuracy.grid import SweepOptions
from hybridkv.pd_accuracy.models import ModelSpec


def _retrying(start: Callable[[], Process], attempts: int = 3) -> Process:
    """`start()`, again while it fails because a port it picked was taken meanwhile (free_port() only finds a port
    free at that moment: the sweep's own client connections may take it before the child binds it)."""
    for attempt in range(attempts):
        try:
            return start()
        except RuntimeError as e:
            if attempt == attempts - 1 or not any(s in str(e) for s in ("in use", "Address already in use")):
                raise
    raise AssertionError("unreachable")


def engine_args(spec: ModelSpec, options: SweepOptions) -> list[str]:
    """The `hybridkv serve` options every instance of `spec` shares (one torch thread each)."""
    args = ["--model", str(spec.folder), "--served-model-name", spec.name, "--threads", "1"]
    args += ["--kv-cache-memory", options.kv_cache_memory, "--enable-admin"]
    return args + (["--max-model-len", str(options.max_model_len)] if options.max_model_len else [])


def plain_server(spec: ModelSpec, options: SweepOptions, env: dict[str, str]) -> Process:
    """One instance without a connector: the single-instance reference."""
    return _retrying(lambda: Process("serve", *engine_args(spec, options), env=env, timeout=options.start_timeout))


def pd_server(spec: ModelSpec, options: SweepOptions, layout: str, env: dict[str, str]) -> Process:
    """One instance with a NixlConnector (kv_both) on a free side-channel port, in `layout`."""

    def start() -> Process:
        extra = {"side_channel_port": 0}  # a free port at bind
        ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        args = [*engine_args(spec, options), "--kv-layout", layout, "--kv-transfer-config", json.dumps(ktc)]
        return Process("serve", *args, env=env, timeout=options.start_timeout)

    return _retrying(start)


class InstancePool:
    """NixlConnector instances of one model, per layout, started when a cell first needs them."""

    def __init__(self, spec: ModelSpec, options: SweepOptions, env: dict[str, str]) -> None:
        self.spec, self.options, self.env = spec, options, env
        self.by_layout: dict[str, list[Process]] = {}

    def take(self, prefill: tuple[str, ...], decode: tuple[str, ...]) -> tuple[list[Process], list[Process]]:
        """Distinct instances for the prefill and decode layouts asked (prefill ones first, by index)."""
        wanted: dict[str, int] = {}
        for layout in (*prefill, *decode):
            wanted[layout] = wanted.get(layout, 0) + 1
        missing = [lay for lay, n in wanted.items() for _ in range(n - len(self.by_layout.get(lay, [])))]
        with ThreadPoolExecutor(max(1, len(missing))) as pool:  # start-ups overlap their imports and loads
            futures = [(lay, pool.submit(pd_server, self.spec, self.options, lay, self.env)) for lay in missing]
        errors = []
        for layout, future in futures:  # keep those that started (stop() ends them), then raise
            try:
                self.by_layout.setdefault(layout, []).append(future.result())
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        used = dict.fromkeys(wanted, 0)

        def pick(layout: str) -> Process:
            used[layout] += 1
            return self.by_layout[layout][used[layout] - 1]

        return [pick(lay) for lay in prefill], [pick(lay) for lay in decode]

    def stop(self) -> None:
        for procs in self.by_layout.values():
            for proc in procs:
                proc.stop()
        self.by_layout.clear()


def router(
    kind: str, prefill: list[Process], decode: list[Process], env: dict[str, str], timeout: float = 600
) -> Process:
    """`hybridkv proxy` or vllm-router's PD mode (round robin) over the instances."""
    if kind == "proxy":
        args = ["proxy", "--prefill", *(p.url for p in prefill), "--decode", *(d.url for d in decode)]
        return _retrying(lambda: Process(*args, env=env, timeout=timeout))
    pools = [a for p in prefill for a in ("--prefill", p.url)] + [a for d in decode for a in ("--decode", d.url)]

    def start() -> Process:
        args = ["--vllm-pd-disaggregation", "--policy", "round_robin", "--prometheus-port", str(free_port()), *pools]
        return Process(*args, program=["vllm-router"], env=env, timeout=timeout)

    return _retrying(start)


@dataclass(frozen=True)
class Counters:
    """What one instance reports: KV reads and failed reads (its connector), and prompt tokens it took."""

    reads: int
    failures: int
    prompt_tokens: int


def counters(p: Process) -> Counters:
    c = httpx.get(f"{p.url}/admin/kv", timeout=30).json()["connector"]
    text = httpx.get(f"{p.url}/metrics", timeout=30).text
    (tokens,) = (s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "vllm:prompt_tokens_total")  # fmt: skip
    return Counters(int(c["kv_transfer_reads_total"]), int(c["kv_transfer_failures_total"]), int(tokens))


def settle(procs: list[Process], timeout: float = 15) -> list[str]:
    """Wait for every instance to hold no block (leases released); what is still held, or an integrity check
    that failed, as one message per instance."""
    problems = []
    for p in procs:
        deadline = time.monotonic() + timeout
        while (state := httpx.get(f"{p.url}/admin/kv", timeout=30).json())["blocks_used"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if state["blocks_used"] or state["integrity"] != "ok":
            problems.append(f"{p.url}: {state['blocks_used']} blocks held, integrity {state['integrity']!r}")
    return problems


def child_env(secret: str) -> dict[str, str]:
    """This process's environment with the mesh secret every instance shares."""
    from hybridkv.connectors.mesh_auth import SECRET_ENV

    return dict(os.environ) | {SECRET_ENV: secret}
