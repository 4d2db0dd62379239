"""The disk tier attacked between two runs of a real server, with a mesh secret set: entries forged without the
secret (well formed, checksummed with the public key), a FIFO and a symlink under entry names are refused and
counted, the rest is served, nothing hangs, outputs equal one instance. A checkpoint with one changed weight
shares nothing."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.connectors.mesh_auth import SECRET_ENV, MeshKeys, mac
from hybridkv.connectors.offload.disk import FIELDS, HEADER
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.metrics_util import scrape
from tests.offload.test_offload_e2e import embedded_prompts
from tests.procs import Process

PROMPTS = embedded_prompts()
ENGINE = ["--threads", "1", "--kv-cache-memory", "4MiB", "--max-model-len", "512", "--kv-offload-cpu", "8MiB",
          "--enable-admin"]  # fmt: skip


def serve(model: Path, disk: Path) -> Process:
    return Process("serve", "--model", str(model), *ENGINE, "--kv-offload-disk", f"{disk}:64MiB")


def run(p: Process) -> list[str]:
    body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=120)
    return [c["text"] for c in r.json()["choices"]]


def counters(p: Process) -> dict[str, float]:
    return {k: v for k, v in scrape(p.url).items() if k.startswith("hybridkv_kv_offload_")}


def assert_clean(p: Process) -> None:
    """No block held, the integrity check passing (stores and loads are over once the requests answered)."""
    state = httpx.get(f"{p.url}/admin/kv", timeout=10).json()
    assert state["integrity"] == "ok" and state["blocks_used"] == 0, state


def single(model: Path) -> list[str]:
    llm = LLM(str(model), kv_cache_memory="4MiB", max_model_len=512)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]


def one_weight_changed(tmp: Path) -> Path:
    out = tmp / "changed"
    shutil.copytree(DEFAULT_MODEL_DIR, out, ignore=shutil.ignore_patterns(".*"))
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0x01  # one bit of one weight, far from where the old fingerprint sampled
    weights.write_bytes(bytes(data))
    return out


@pytest.fixture
def secret(monkeypatch):
    value = secrets.token_hex(16)
    monkeypatch.setenv(SECRET_ENV, value)
    return MeshKeys.derive(value.encode())


def fill(disk: Path) -> Path:
    """Run the prompts once so their blocks reach the disk tier; the entry directory."""
    first = serve(DEFAULT_MODEL_DIR, disk)
    try:
        run(first)
        deadline = time.monotonic() + 10
        while counters(first)["hybridkv_kv_offload_cpu_to_disk_blocks_total"] < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        first.stop()
    (entry_dir,) = [d for d in disk.iterdir() if d.is_dir()]
    return entry_dir


def test_special_files_under_entry_names_are_removed_not_waited_on(tmp_path, secret):
    expected, entry_dir = single(DEFAULT_MODEL_DIR), fill(tmp_path / "disk")
    assert entry_dir.stat().st_mode & 0o777 == 0o700
    entries = sorted(entry_dir.glob("*.kv"))
    assert len(entries) >= 6 and all(e.stat().st_mode & 0o777 == 0o600 for e in entries)
    fifo, link = entries[:2]
    fifo.unlink()
    os.mkfifo(fifo)
    link.unlink()
    link.symlink_to(entries[2])
    second = serve(DEFAULT_MODEL_DIR, tmp_path / "disk")
    try:
        start = time.monotonic()
        assert run(second) == expected
        assert time.monotonic() - start < 30  # nothing waited on the FIFO
        c = counters(second)
        assert c["hybridkv_kv_offload_corrupt_entries_total"] == 2  # both refused at start-up, never opened
        assert c["hybridkv_kv_offload_disk_hit_blocks_total"] > 0  # the untouched entries were served
        assert not fifo.is_fifo() and not link.is_symlink()
        assert_clean(second)
    finally:
        second.stop()


def test_entries_forged_without_the_secret_are_refused(tmp_path, secret):
    """Each entry of the full-attention group (every prompt loads its first block) is replaced by a well-formed
    entry with another payload, checksummed with the public key: what anyone without the secret can write."""
    expected, entry_dir = single(DEFAULT_MODEL_DIR), fill(tmp_path / "disk")
    forged = sorted(entry_dir.glob("*-g0.kv"))
    assert forged
    for entry in forged:
        raw = entry.read_bytes()
        fields, payload = raw[: FIELDS.size], bytes(len(raw) - HEADER.size)
        entry.write_bytes(fields + mac(MeshKeys.derive(None).disk, fields, payload) + payload)
    second = serve(DEFAULT_MODEL_DIR, tmp_path / "disk")
    try:
        assert run(second) == expected
        c = counters(second)
        assert c["hybridkv_kv_offload_corrupt_entries_total"] >= 1 and c["hybridkv_kv_offload_load_failures_total"] >= 1
        assert_clean(second)
    finally:
        second.stop()


def test_a_checkpoint_with_one_changed_weight_shares_no_disk_entries(tmp_path, secret):
    disk, changed = tmp_path / "disk", one_weight_changed(tmp_path)
    fill(disk)
    other = serve(changed, disk)
    try:
        assert run(other) == single(changed)
        c = counters(other)
        assert c["hybridkv_kv_offload_disk_hit_blocks_total"] == 0 and c["hybridkv_kv_offload_hits_total"] == 0
        assert len([d for d in disk.iterdir() if d.is_dir()]) == 2  # its own directory
        assert_clean(other)
    finally:
        other.stop()
