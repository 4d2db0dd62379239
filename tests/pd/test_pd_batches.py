"""A completions batch under PD, with real processes: every prompt gets its own lease and params, the decoder
reads every prompt's KV, outputs equal one instance, and no lease outlives the request. Through our proxy and
through vllm-router's PD mode (the router that users deploy), which passes the batch params on unread."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.pd_util import HELDOUT, assert_clean, kv_state, proxy, server, single_instance
from tests.procs import Process, free_port, together, wait_healthy

MODEL, MODEL_PROMPTS = str(DEFAULT_MODEL_DIR), [it["prompt"] for it in HELDOUT[60:63]]


@pytest.fixture(scope="module")
def mesh():
    p, d = together(server(MODEL, wait=False), server(MODEL, "packed", wait=False))
    yield p, d
    p.stop()
    d.stop()


class Router:
    """vllm-router in PD mode over one prefill and one decode instance."""

    def __init__(self, p: Process, d: Process) -> None:
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["vllm-router", "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url, "--port",
                str(self.port), "--policy", "round_robin"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.url, self.proc, timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


def batch_through(url: str, d: Process) -> tuple[list[str], dict]:
    before = kv_state(d)["connector"]
    body = {"model": "default-model", "prompt": MODEL_PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = kv_state(d)["connector"]
    return [c["text"] for c in r.json()["choices"]], {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("router", ["hybridkv proxy", "vllm-router"])
def test_a_three_prompt_batch_moves_every_prompts_kv(mesh, router):
    p, d = mesh
    if router == "vllm-router" and shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (it is in the test extra)")
    front = proxy(p, d) if router == "hybridkv proxy" else Router(p, d)
    try:
        texts, moved = batch_through(front.url, d)
        assert texts == single_instance(MODEL, MODEL_PROMPTS)
        assert moved["kv_transfer_reads_total"] == 3 and moved["kv_transfer_bytes_total"] > 0
        assert moved["kv_transfer_failures_total"] == 0
        deadline = time.monotonic() + 5
        while kv_state(p)["connector"]["kv_leases_held"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv_state(p)["connector"]["kv_leases_held"] == 0
        assert_clean(p, d)
    finally:
        front.stop()
