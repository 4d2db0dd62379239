"""KVEventsConfig: vLLM's `--kv-events-config`, the same JSON keys and defaults, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridkv.connectors.pd.params import is_loopback  # a name or an interface is not: it may leave
from hybridkv.json_config import json_object

PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp://", "ipc://", "inproc://")


def _endpoint_error(key: str, value: str) -> str | None:
    if not value.startswith(SCHEMES):
        return f"kv_events_config.{key} must start with one of {', '.join(SCHEMES)}, got {value!r}"
    if value.startswith("tcp://"):
        port = value.rpartition(":")[2]
        # Port 0: a free port chosen at bind time, named by GET /kv_event_sources (as in vLLM).
        if ":" not in value[len("tcp://") :] or not port.isdigit() or not 0 <= int(port) < 65536:
            return f"kv_events_config.{key} needs a port in [0, 65535] (0: a free one, e.g. tcp://*:0); got {value!r}"
    return None


def tcp_host(endpoint: str) -> str | None:
    """ "tcp://HOST:PORT" -> HOST (brackets stripped); None for ipc:// and inproc://."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")


def _local(endpoint: str) -> str:
    """A wildcard endpoint narrowed to loopback: tcp://*:P -> tcp://127.0.0.1:P, tcp://[::]:P -> tcp://[::1]:P."""
    host = tcp_host(endpoint)
    port = endpoint.rpartition(":")[2]
    if host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    if host == "::":
        return f"tcp://[::1]:{port}"
    return endpoint


@dataclass(frozen=True)
class KVEventsConfig:
    """Field for field vLLM's KVEventsConfig, plus `allow_remote` (ours). `publisher` None means "zmq" when events
    are enabled, else "null".

    `endpoint` binds when it is a wildcard (`*`), an IPv6 address (`::`), `ipc://` or `inproc://`, and connects
    otherwise (vLLM's rule: bind the stable side, connect the volatile one). `replay_endpoint` always binds.

    The stream carries every unsalted prompt's token ids, so it stays on this host unless `allow_remote`: a
    wildcard binds loopback only (`bind_endpoint`), and a TCP endpoint naming another host is a start-up error.
    With `allow_remote` a wildcard binds every interface, as in vLLM, and start-up warns what that exposes."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it a batch is dropped
    topic: str = ""
    allow_remote: bool = False  # ours: let the stream leave this host (bind every interface, or connect out)

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            got = self.enable_kv_cache_events
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, got {got!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            choices = ", ".join(PUBLISHERS)
            raise ValueError(f"kv_events_config.publisher must be one of {choices}, got {self.publisher!r}")
        for key in ("endpoint", "replay_endpoint", "topic"):
            value = getattr(self, key)
            if not isinstance(value, str) and not (key == "replay_endpoint" and value is None):
                raise ValueError(f"kv_events_config.{key} must be a string, got {value!r}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            error = None if value is None else _endpoint_error(key, value)
            if error:
                raise ValueError(error)
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{key} must be a positive integer, got {value!r}")
        if not isinstance(self.allow_remote, bool):
            raise ValueError(f"kv_events_config.allow_remote must be true or false, got {self.allow_remote!r}")
        for key in ("endpoint", "replay_endpoint"):
            host = tcp_host(getattr(self, key) or "")
            if host not in (None, "*", "0.0.0.0", "::") and not is_loopback(host) and not self.allow_remote:
                raise ValueError(
                    f"kv_events_config.{key} {getattr(self, key)} leaves this host, and the stream carries every "
                    'unsalted prompt\'s token ids: add "allow_remote": true to publish them there'
                )
        if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):  # two port 0s: two ports
            raise ValueError("kv_events_config.replay_endpoint must differ from endpoint (two sockets, two addresses)")

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds `endpoint` (else it connects to it)."""
        e = self.endpoint
        return "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))

    def bind_endpoint(self, endpoint: str) -> str:
        """Where a binding socket listens: a wildcard narrowed to loopback unless `allow_remote`."""
        return endpoint if self.allow_remote else _local(endpoint)

    @property
    def exposed(self) -> bool:
        """Whether a socket listens beyond loopback or sends to another host (what start-up warns about)."""
        ends = [self.endpoint] + ([self.replay_endpoint] if self.replay_endpoint else [])
        return any((h := tcp_host(self.bind_endpoint(e))) is not None and not is_loopback(h) for e in ends)

    @staticmethod
    def parse(value: str | dict[str, Any]) -> KVEventsConfig:
        """From a JSON string or a dict; unknown keys are errors that name them."""
        value = json_object(value, "--kv-events-config", (f.name for f in fields(KVEventsConfig)))
        return KVEventsConfig(**value)
