"""What the attack tests need: the mesh secret and keys (the mesh itself is the `secure_mesh` fixture of
conftest.py), prompts, and the ways attackers and mesh members talk to it."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from hybridkv.connectors.identity import compat_hash, model_fingerprint
from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd.params import ParamLimits, parse_transfer_params
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.kv.planner import CacheConfig, plan_kv_cache
from tests.pd.pd_util import HELDOUT, complete, kv_state

MODEL = str(DEFAULT_MODEL_DIR)
SECRET = secrets.token_hex(16)
KEYS, PUBLIC = MeshKeys.derive(SECRET.encode()), MeshKeys.derive(None)
WRONG = MeshKeys.derive(b"a guess at the secret, 16+ bytes")
VICTIM, ATTACKER = HELDOUT[50]["prompt"], HELDOUT[51]["prompt"]  # different secret codes, same shape


def channel(p) -> int:
    """The side channel's port as the instance bound it (its start-up log names it)."""
    return int(re.search(r"side channel 127\.0\.0\.1:(\d+)", p.log.read_text(errors="replace")).group(1))


def stats(p) -> dict:
    return kv_state(p)["connector"]


def text(out: dict) -> str:
    assert "choices" in out, out
    return out["choices"][0]["text"]


def compat_of(model: str) -> str:
    kv = model_kv_from_hf(load_hf_config(model), block_size=16, dtype="float32")
    plan = plan_kv_cache(kv, CacheConfig(32 << 20, 512))
    return compat_hash(plan, model_fingerprint(model), "float32")


def resign(params: dict, keys: MeshKeys, **changes) -> dict:
    """`params` changed and signed again with `keys` (PUBLIC: what anyone can compute without the secret)."""
    typed = parse_transfer_params(params, ParamLimits(len(params["remote_block_ids"]), 64, 512))
    return replace(typed, **changes).signed(keys.params).to_json()


COUNTERS = {
    "refused": "kv_transfer_params_refused_total",
    "failures": "kv_transfer_failures_total",
    "reads": "kv_transfer_reads_total",
}
LEASE_S = 3  # the prefill's kv_lease_s (pd_util.server): params older than this may name blocks already freed


def one_request(d, issue: Callable[[], dict], send: Callable[[dict], dict], **want: int) -> tuple[dict, dict]:
    """Issue params (`issue`: the prefill's, then any forgery), send them to decoder `d` (`send`), and return the
    output and the decoder's counter deltas for that one request (refused params, failed loads, reads: COUNTERS).
    While the deltas are not `want` and the request ended more than LEASE_S after the params were issued (a loaded
    machine: the lease may have lapsed, or the params expired, before the decoder used them), it goes again with
    fresh params, for up to two minutes. A request on time is never retried: a wrong outcome then is the caller's
    failure, whatever the load."""
    want = {k: want.get(k, 0) for k in COUNTERS}
    deadline = time.monotonic() + 120
    while True:
        before, issued = stats(d), time.monotonic()
        out = send(issue())
        after = stats(d)
        delta = {k: int(after[name] - before[name]) for k, name in COUNTERS.items()}
        if delta == want or time.monotonic() - issued <= LEASE_S or time.monotonic() > deadline:
            return out, delta


def through_proxy(x, prompts: list[str], single: dict) -> None:
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: complete(x.url, q), prompts))
    assert [text(o) for o in outs] == [single[q] for q in prompts]
