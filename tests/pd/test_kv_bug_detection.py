"""The embedded model as a KV-transfer bug detector: a decoder that reads, where it can, the blocks another request
was served from (the previous read's remote block ids) instead of its own loses at least 0.3 of its held-out
accuracy through the proxy, while its reads show the (buggy) fast path ran, not a recompute.

The bug lives in a sitecustomize.py on the decoder's PYTHONPATH that wraps the reader's `block_moves`; the prefill
instance and the proxy are untouched. (The engine-side KV bugs are in tests/tasks/test_default_model_kv.py.)"""

from __future__ import annotations

import json
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.tasks.kv_recall import read_jsonl, score
from tests.pd.pd_util import ENGINE, fronted, kv_state, server
from tests.procs import Process

MODEL = str(DEFAULT_MODEL_DIR)
ITEMS = read_jsonl(DEFAULT_MODEL_DIR / "heldout.jsonl")[:48]

SITECUSTOMIZE = """
from hybridkv.connectors.pd import reader

_moves = reader.block_moves
_previous = []


def block_moves(local, remote, first_token, end_token, block_size):
    previous, _previous[:] = _previous[:], [list(g) for g in remote]
    if previous:
        remote = [
            [p[i] if i < len(p) and p[i] else r for i, r in enumerate(theirs)] for theirs, p in zip(remote, previous)
        ]
    return _moves(local, remote, first_token, end_token, block_size)


reader.block_moves = block_moves
"""


def accuracy(url: str) -> float:
    def one(item: dict) -> bool:
        body = {"prompt": item["prompt"], "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
        return score(
            httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"], item["answer"]
        )

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, ITEMS)) / len(ITEMS)


@pytest.fixture(scope="module")
def baseline() -> float:
    outs = LLM(MODEL).generate([it["prompt"] for it in ITEMS], SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    return sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, ITEMS)) / len(ITEMS)


def buggy_decoder(folder: Path) -> Process:
    """A decode instance whose reader takes the previous read's remote blocks (sitecustomize.py in `folder`)."""
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    ktc = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 0},
    }
    args = ["--model", MODEL, *ENGINE, "--enable-admin", "--kv-transfer-config", json.dumps(ktc)]
    return Process("serve", *args, env=env, wait=False)  # started with the prefill (fronted)


def test_blocks_read_from_another_request_cost_at_least_0_3(baseline, tmp_path, monkeypatch):
    from hybridkv.connectors.mesh_auth import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, secrets.token_hex(16))
    prefill, decoder, router = fronted(server(MODEL, wait=False), buggy_decoder(tmp_path))
    try:
        acc = accuracy(router.url)
        connector = kv_state(decoder)["connector"]
    finally:
        for proc in (router, decoder, prefill):
            proc.stop()
    assert connector["kv_transfer_reads_total"] >= len(ITEMS) and connector["kv_transfer_failures_total"] == 0, (
        connector
    )
    assert baseline >= 0.95 and acc <= baseline - 0.3, (baseline, acc)
    print(f"blocks of another request: {acc:.3f} against {baseline:.3f} from one instance")
