"""kv_transfer_params from a client, parsed into the typed forms of `protocol` (vLLM's field names).

A request to a prefill instance carries `{"do_remote_decode": true}` (`RemoteDecode`). When it finishes, the
prefill instance keeps its blocks under a lease and answers with a `RemotePrefill`: where to read (engine id, side
channel host and port), what (block ids per group, prompt hash and token count), the lease (a 128-bit random id)
and until when, all covered by a signature made with the mesh's params key. The decoder parses every field with
the limits below and checks the signature before it contacts anyone; the prefill instance serves lease operations
only for the lease id and signature it issued, so params cannot be pointed at another request's blocks.

Everything here is hostile input until `parse_transfer_params` returned: it raises `ValueError` naming the field.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.connectors.pd.transfer_params import (
    PREFILL_KEYS,
    RemoteBatch,
    RemoteDecode,
    RemotePrefill,
    TransferParams,
)

MAX_BLOCK_ID = (1 << 31) - 1
_ENGINE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9.:_-]{1,253}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# vLLM's proxies send these to a prefill instance, unset; they mean nothing there.
_UNSET_ON_PREFILL = ("do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
                     "remote_request_id")  # fmt: skip


@dataclass(frozen=True)
class ParamLimits:
    """What this instance can take: its KV groups, the most blocks a request of max_model_len holds, and the
    pages of one recurrent-state entry (0: no state group)."""

    num_groups: int
    max_blocks: int
    max_tokens: int
    state_pages: int = 0


MAX_BATCH = 1024


def parse_transfer_params(raw: Any, limits: ParamLimits) -> TransferParams | None:
    """The typed params, or None when they ask for nothing. ValueError names the first bad field."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError("kv_transfer_params must be a JSON object")
    if "batch" in raw:
        return _batch(raw, limits)
    if raw.get("do_remote_decode") is True:
        unknown = set(raw) - {"do_remote_decode", *_UNSET_ON_PREFILL}
        if unknown:
            raise ValueError(f"kv_transfer_params.{sorted(unknown)[0]}: not a field of a prefill request")
        for key in _UNSET_ON_PREFILL:
            if raw.get(key) not in (None, False):
                raise ValueError(f"kv_transfer_params.{key}: must be unset when do_remote_decode is true")
        return RemoteDecode()
    if raw.get("do_remote_prefill") is not True:
        for key in ("do_remote_decode", "do_remote_prefill"):
            if raw.get(key) not in (None, False):
                raise ValueError(f"kv_transfer_params.{key}: must be true or false")
        if set(raw) - {"do_remote_decode", "do_remote_prefill"}:
            raise ValueError("kv_transfer_params: remote_* fields need do_remote_prefill: true")
        return None
    return _remote_prefill(raw, limits)


def _batch(raw: Mapping[str, Any], limits: ParamLimits) -> RemoteBatch:
    if set(raw) - {"do_remote_prefill", "do_remote_decode", "batch"} or raw.get("do_remote_prefill") is not True:
        raise ValueError("kv_transfer_params: a batch takes exactly do_remote_prefill: true and batch")
    if raw.get("do_remote_decode") not in (None, False):
        raise ValueError("kv_transfer_params.do_remote_decode: must be false with do_remote_prefill")
    items = raw["batch"]
    if not isinstance(items, list) or not 0 < len(items) <= MAX_BATCH:
        raise ValueError(f"kv_transfer_params.batch: a list of 1 to {MAX_BATCH} entries")
    out: list[RemotePrefill | None] = []
    for i, item in enumerate(items):
        if item is None:
            out.append(None)
            continue
        try:
            if not isinstance(item, Mapping) or item.get("do_remote_prefill") is not True:
                raise ValueError("kv_transfer_params: each entry must be a prefill's params or null")
            out.append(_remote_prefill(item, limits))
        except ValueError as e:
            raise ValueError(str(e).replace("kv_transfer_params", f"kv_transfer_params.batch[{i}]", 1)) from e
    return RemoteBatch(tuple(out))


def _remote_prefill(raw: Mapping[str, Any], limits: ParamLimits) -> RemotePrefill:
    unknown = set(raw) - PREFILL_KEYS
    if unknown:
        raise ValueError(f"kv_transfer_params.{sorted(unknown)[0]}: unknown field")
    if raw.get("do_remote_decode") not in (None, False):
        raise ValueError("kv_transfer_params.do_remote_decode: must be false with do_remote_prefill")
    return RemotePrefill(
        engine_id=_text(raw, "remote_engine_id", _ENGINE_ID),
        host=_host(raw),
        port=_int(raw, "remote_port", 1, 65535),
        request_id=_text(raw, "remote_request_id", _REQUEST_ID),
        lease_id=_text(raw, "lease_id", _HEX32),
        block_ids=_block_ids(raw, limits),
        num_tokens=_int(raw, "remote_num_tokens", 1, limits.max_tokens),
        prompt_hash=_text(raw, "prompt_hash", _HEX64),
        expires_at=_int(raw, "expires_at", 0, 1 << 40),
        signature=_text(raw, "signature", _HEX64),
        state_pages=_state_pages(raw, limits),
    )


def _field(raw: Mapping[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"kv_transfer_params.{key}: missing")
    return raw[key]


def _text(raw: Mapping[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = _field(raw, key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"kv_transfer_params.{key}: malformed")
    return value


def _int(raw: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = _field(raw, key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"kv_transfer_params.{key}: must be an integer in [{low}, {high}]")
    return value


def _host(raw: Mapping[str, Any]) -> str:
    host = _text(raw, "remote_host", _HOST)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not all(part and len(part) <= 63 for part in host.split(".")):
            raise ValueError("kv_transfer_params.remote_host: not an IP address or host name") from None
    return host


def _block_ids(raw: Mapping[str, Any], limits: ParamLimits) -> tuple[tuple[int, ...], ...]:
    value = _field(raw, "remote_block_ids")
    if not isinstance(value, list) or len(value) != limits.num_groups:
        raise ValueError(f"kv_transfer_params.remote_block_ids: must be {limits.num_groups} lists, one per KV group")
    out = []
    for g, ids in enumerate(value):
        if not isinstance(ids, list) or len(ids) > limits.max_blocks:
            raise ValueError(f"kv_transfer_params.remote_block_ids[{g}]: a list of at most {limits.max_blocks} ids")
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
                raise ValueError(f"kv_transfer_params.remote_block_ids[{g}]: ids must be integers in [0, 2**31)")
        out.append(tuple(ids))
    return tuple(out)


def _state_pages(raw: Mapping[str, Any], limits: ParamLimits) -> tuple[tuple[int, ...], ...]:
    """`remote_state_pages`: per state entry, runs [first, count] that expand to exactly `limits.state_pages`
    distinct ids. Absent is () (a plan without state; the reader checks it against the tables)."""
    key = "kv_transfer_params.remote_state_pages"
    if "remote_state_pages" not in raw:
        return ()
    value, m = raw["remote_state_pages"], limits.state_pages
    if not m or not isinstance(value, list) or not 0 < len(value) <= limits.max_blocks:
        raise ValueError(f"{key}: a list of at most {limits.max_blocks} entries, only for a recurrent-state model")
    out = []
    for e, runs in enumerate(value):
        if not isinstance(runs, list) or not 0 < len(runs) <= m:
            raise ValueError(f"{key}[{e}]: a list of at most {m} runs [first id, count]")
        pages: list[int] = []
        for run in runs:
            ok = isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)
            if not ok or not 0 < run[1] <= m - len(pages) or not 0 < run[0] <= MAX_BLOCK_ID - run[1]:
                raise ValueError(f"{key}[{e}]: runs are [first id, count] of ids in [1, 2**31), {m} ids in all")
            pages.extend(range(run[0], run[0] + run[1]))
        if len(pages) != m or len(set(pages)) != m:
            raise ValueError(f"{key}[{e}]: must name {m} distinct pages (this instance's state entry)")
        out.append(tuple(pages))
    return tuple(out)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
