"""The connector interface: how KV moves between this engine and something outside it (a peer instance, a CPU or
disk tier).

A connector hooks into the scheduler at three points (what can be loaded for a new request, after its blocks are
allocated, when it finishes) and does its own I/O, reporting back through `poll()`. It sees block ids per group and
the KVPlan, never layer names, so KV-sharing consumers (no spec, no memory) cannot reach it.

Invariant: a block the connector may still read from or write into is never freed. While it loads a request, or
holds a finished one (a lease for a remote reader), the request's block table stays allocated; the scheduler frees
it only when `poll()` lists the request in `released` (or `abort()` / `request_finished()` say so right away).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.json_config import json_object
from hybridkv.kv.events import KVEventLog
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.histogram import HistogramSnapshot
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan
from hybridkv.request.state import Request, RequestStatus

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `--kv-transfer-config` shape: kv_connector, kv_role, kv_connector_extra_config."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kv_connector not in known_connectors():
            known = ", ".join(known_connectors())
            raise ValueError(f"kv_transfer_config.kv_connector {self.kv_connector!r} is unknown; known: {known}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")

    @staticmethod
    def parse(value: str | dict[str, Any]) -> KVTransferConfig:
        """From a JSON string or a dict; unknown top-level keys are errors that name them."""
        value = json_object(value, "--kv-transfer-config", ("kv_connector", "kv_role", "kv_connector_extra_config"))
        if "kv_connector" not in value:
            raise ValueError("--kv-transfer-config needs kv_connector, e.g. NixlConnector")
        return KVTransferConfig(**value)

    def option(self, key: str, default: Any, kind: Callable[[Any], Any] = lambda v: v) -> Any:
        """An extra-config value converted by `kind`; a conversion error names the key."""
        if key not in self.kv_connector_extra_config:
            return default
        try:
            return kind(self.kv_connector_extra_config[key])
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_connector_extra_config.{key}: {e}") from e


@dataclass
class ConnectorEvents:
    """What changed since the last poll."""

    loaded: dict[str, bool] = field(default_factory=dict)  # request -> its KV load finished (True) or failed
    errors: dict[str, str] = field(default_factory=dict)  # request -> why its load failed
    released: list[str] = field(default_factory=list)  # requests whose blocks the connector let go: free them


@dataclass(frozen=True)
class EngineIdentity:
    """What a connector needs to know about its engine: a unique id and what peers must match."""

    engine_id: str
    model_fingerprint: str  # config and weights identity
    dtype: str


class TransferRefused(Exception):
    """kv_transfer_params that parsed but did not verify, under kv_load_failure_policy "fail" (an HTTP 403)."""


# A load's stages as vLLM's gauge names them: not started yet (a handshake, a lease to confirm), KV arriving, KV in
# and the request waiting to run.
FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")


class KVConnector:
    """Runs on the engine thread. It may own I/O threads, but touches scheduler state only through return values."""

    load_failure_policy = "recompute"  # or "fail": what the scheduler does with a request whose load failed
    # Loads that the request computes on from end at a multiple of this many blocks (an exact engine's split
    # unit: its prefill tiles begin there); set by the engine before `register`.
    resume_unit = 1

    def pages(self, block_id: int) -> tuple[int, ...]:
        """The block ids a table entry stands for: a recurrent-state bundle's pages (`state_plan`), else itself.
        The engine replaces it with its coordinator's before `register`; only code that moves bytes asks."""
        return (block_id,)

    def accept_transfer_params(self, raw: Any, num_prompts: int = 1) -> list[Any]:
        """Client-supplied kv_transfer_params (hostile) for a request of `num_prompts` prompts -> per prompt, the
        typed value `Request.kv_transfer_params` carries (None: nothing to do). Called on the HTTP side before
        the request is queued, so it must be thread-safe and touch no engine state. Raises ValueError naming a
        malformed field (a 400), or TransferRefused."""
        if raw:
            raise ValueError("kv_transfer_params: this server's KV connector takes none")
        return [None] * num_prompts

    def merge_transfer_params(self, outs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """The response's one kv_transfer_params for the prompts' own (`request_finished`'s), in prompt order."""
        return outs[0] if len(outs) == 1 else None

    def cancel_transfer(self, raw: Any) -> bool:
        """The client will not use these kv_transfer_params (this instance handed them out): free what they hold.
        Thread-safe. True when something was released."""
        return False

    def register(self, plan: KVPlan, memory: KVCacheMemory) -> None:
        """Called once with the engine's plan and KV memory, before any request."""
        raise NotImplementedError

    def num_external_tokens(self, req: Request, num_local_tokens: int) -> int:
        """Tokens after the local prefix hit (`num_local_tokens`) this connector can load; 0 for none. At least
        the last prompt token is always left to compute."""
        return 0

    def start_load(self, req: Request, block_ids: list[list[int]], num_local_tokens: int) -> None:
        """Blocks for the whole prompt are allocated (`block_ids` per group; 0 where no token reads); load
        tokens [num_local_tokens, num_local_tokens + req.num_external_tokens). Report through `poll()`."""

    def blocks_computed(self, req: Request, block_ids: list[list[int]], num_computed_tokens: int) -> None:
        """After each step that ran `req`: tokens [0, num_computed_tokens) now have KV in `block_ids` (per group;
        0 where a sliding window let a block go) that may be reused by other requests (the scheduler passes only
        what its prefix cache may publish: a recurrent-state plan never offers KV or states computed one token at
        a time). Stores must finish copying before returning, or hold the blocks: the next step may reuse freed
        ones."""

    def hands_off_prompt(self, req: Request) -> bool:
        """Whether a remote reader may resume `req` at its last prompt token: the scheduler then keeps its
        recurrent state before that token aside while it decodes on (`KVCacheCoordinator.keep_state`)."""
        return False

    def request_finished(self, req: Request, block_ids: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        """Called once per finished request before its blocks are freed; `block_ids` hold, in the state group,
        the state kept for a remote reader (`hands_off_prompt`). Returns (hold the blocks until `released`,
        kv_transfer_params for the client)."""
        return False, None

    def abort(self, request_id: str) -> bool:
        """A request waiting for its load was aborted. True: its blocks may be freed now; False: a transfer
        may still write them, so they are listed in `released` later."""
        return True

    def poll(self) -> ConnectorEvents:
        """Advance transfers and leases; report what finished."""
        raise NotImplementedError

    def has_pending(self) -> bool:
        """Transfers in flight or blocks held: the engine must keep polling."""
        return False

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s, or until something may have changed (never a busy loop)."""

    def next_deadline(self) -> float | None:
        """Seconds until the connector needs a poll with no other event (a lease expiry); None for never."""
        return None

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake()` is called from the connector's own threads when `poll()` has something new."""

    def dead_threads(self) -> list[str]:
        """Names of the connector's background threads that have died (the server reports itself unhealthy)."""
        return []

    def set_kv_events(self, events: KVEventLog) -> None:
        """KV events are on: a connector with a cache tier of its own logs the blocks that enter and leave it
        (with the tier's `medium`), from any of its threads. Called once after `register`."""

    def kv_event_tiers(self) -> dict[str, dict[int, list[BlockHash]]]:
        """Medium -> group -> the hashes its tier holds now, as its KV events report them (/admin/kv)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for /metrics: names without the hybridkv_ prefix, or vLLM's own ("vllm:..."); a
        name ending in _total is a counter."""
        return {}

    def fetch_stages(self) -> dict[str, int]:
        """Requests loading KV by stage (FETCH_STAGES; vLLM's num_requests_kv_fetch_by_stage)."""
        return {}

    def histograms(self) -> dict[str, HistogramSnapshot]:
        """vLLM's per-transfer histograms this connector fills (full metric names), as snapshots."""
        return {}

    def where(self) -> str:
        """What the start-up log names besides the connector's name (an address it listens on), or ""."""
        return ""

    def shutdown(self) -> None:
        """Release threads, sockets and registrations."""


ConnectorFactory = Callable[[KVTransferConfig, EngineIdentity], KVConnector]
CONNECTORS: dict[str, ConnectorFactory] = {}  # filled by `register_connector` as each connector's module loads
# The module that registers each built-in connector, imported when its name is first asked for: importing one
# connector's parts (the proxy reads PD's transfer params) then loads no other connector, and not torch.
CONNECTOR_MODULES = {
    "NixlConnector": "hybridkv.connectors.pd.connector",
    "OffloadingConnector": "hybridkv.connectors.offload.connector",
}


def known_connectors() -> list[str]:
    return sorted(set(CONNECTORS) | set(CONNECTOR_MODULES))


def connector_factory(name: str) -> ConnectorFactory:
    """The factory registered under `name` (a `KVTransferConfig` checked it is known), its module loaded once."""
    if name not in CONNECTORS and name in CONNECTOR_MODULES:
        importlib.import_module(CONNECTOR_MODULES[name])
    return CONNECTORS[name]


def register_connector(name: str) -> Callable[[ConnectorFactory], ConnectorFactory]:
    def add(factory: ConnectorFactory) -> ConnectorFactory:
        CONNECTORS[name] = factory
        return factory

    return add


def finished_ok(req: Request) -> bool:
    return req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
