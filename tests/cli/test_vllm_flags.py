"""`vllm serve` habits (`cli/vllm_flags.py`): the positional model, vLLM's engine flags with vLLM's meanings, the
no-op flags accepted, tensor parallelism refused with what to do instead."""

import os
import re
import subprocess

import httpx
import pytest

from hybridkv.cli.vllm_flags import check_vllm_flags, resolve_model
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.engine.kv_sizing import weight_bytes
from tests.metrics_util import scrape
from tests.procs import Process

SMALL = ["--kv-cache-memory", "16MiB", "--max-model-len", "256", "--threads", "1"]


def test_the_model_is_positional_or_an_option_but_not_two_folders():
    assert resolve_model("a", None) == resolve_model(None, "a") == resolve_model("a", "a") == "a"
    assert resolve_model(None, None) is None
    with pytest.raises(ValueError, match="given twice"):
        resolve_model("a", "b")
    check_vllm_flags(1, True)
    with pytest.raises(ValueError, match="no tensor parallelism"):
        check_vllm_flags(2, True)


def test_vllm_serve_flags_start_a_server_with_their_meanings():
    """`hybridkv serve MODEL` with vLLM's flags: the block size reaches the KV plan, and with prefix caching off a
    repeated prompt computes every token again (no hit)."""
    server = Process(
        "serve", str(DEFAULT_MODEL_DIR), *SMALL, "--block-size", "32", "--no-enable-prefix-caching", "-tp", "1",
        "--enforce-eager", "--trust-remote-code", "--max-num-batched-tokens", "64", "--enable-chunked-prefill",
        "--prefix-caching-hash-algo", "sha256_cbor", env=os.environ | {"PYTHONHASHSEED": "0"},
    )  # fmt: skip
    try:
        body = {"model": DEFAULT_MODEL_DIR.name, "prompt": "the cat sat on the mat " * 8, "max_tokens": 1}
        for _ in range(2):
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        hits = scrape(server.url)["vllm:prefix_cache_hits_total"]
        log = server.log.read_text()
    finally:
        server.stop()
    assert "block size 32" in log
    assert "block hashes: sha256_cbor, root from PYTHONHASHSEED=0" in log
    assert hits == 0


def test_gpu_memory_utilization_sizes_the_cache_and_names_serve_as_vllms():
    """`--gpu-memory-utilization` (a fraction of this machine's memory chosen to leave ~64 MiB of KV past the
    weights), several served names, and vLLM's log: banner, plan, listening line, access log."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = weight_bytes(DEFAULT_MODEL_DIR, "float32")
    fraction = (weights + (64 << 20)) / total
    server = Process(
        "serve", str(DEFAULT_MODEL_DIR), "--max-model-len", "2048", "--gpu-memory-utilization", f"{fraction:.9f}",
        "--enable-prefix-caching", "-tp", "1", "--threads", "1", "--served-model-name", "first", "second",
        "--seed", "7",
    )  # fmt: skip
    try:
        listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
        answers = []
        for name in ("first", "second"):
            body = {"model": name, "prompt": "the cat sat", "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            answers.append((r.status_code, r.json()["model"]))
        other = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "third"}, timeout=60)
        log = server.log.read_text()
    finally:
        server.stop()
    assert listed == ["first", "second"] and answers == [(200, "first"), (200, "first")]
    assert other.status_code == 404 and "'first' or 'second'" in other.text
    budget = re.search(r"KV cache budget: .* = ([\d.]+) MiB \(--gpu-memory-utilization\)", log)
    assert budget and abs(float(budget.group(1)) - 64) < 0.1, log
    for line in ("hybridkv 0.", "KV plan:", "listening on http://127.0.0.1:", '"POST /v1/completions HTTP/1.1" 200'):
        assert line in log, line


def test_tensor_parallelism_and_two_models_are_refused_at_start():
    for extra, says in (
        (["-tp", "2"], "tensor parallelism"),
        ([str(DEFAULT_MODEL_DIR), "--model", "/elsewhere"], "given twice"),
        (["--prefix-caching-hash-algo", "md5"], "must be one of hybridkv, sha256, sha256_cbor, xxhash, xxhash_cbor"),
        (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"], "give one"),
        (["--gpu-memory-utilization", "0.0000001"], "does not cover the weights"),  # --kv-cache-memory dropped
    ):
        small = SMALL[2:] if "does not cover the weights" in says else SMALL
        done = subprocess.run(["hybridkv", "serve", *small, *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, extra
        assert says in done.stderr, done.stderr
