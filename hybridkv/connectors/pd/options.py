"""NixlConnector's `kv_connector_extra_config`, checked once into a frozen value (unknown keys, bad kinds and
ranges are a `ValueError` naming the key)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.connectors.base import KVTransferConfig

POLICIES = ("recompute", "fail")  # kv_load_failure_policy: what a request whose load failed does
KEYS = frozenset({"side_channel_host", "side_channel_port", "kv_lease_s", "kv_load_failure_policy",
                  "kv_transfer_timeout_s", "enable_cross_layers_blocks", "backends", "secret_file"})  # fmt: skip


@dataclass(frozen=True)
class NixlOptions:
    host: str = "127.0.0.1"  # the side channel's address
    port: int = 5600  # 0: a free port
    lease_s: float = 30.0  # how long a prefill instance keeps a finished request's blocks for a reader
    timeout_s: float = 30.0  # a decoder's whole load, handshake to release
    load_failure_policy: str = "recompute"
    backends: tuple[str, ...] = ("UCX",)
    secret_file: str | None = None  # else HYBRIDKV_KV_SECRET (`mesh_auth.load_secret`)

    @classmethod
    def of(cls, config: KVTransferConfig) -> NixlOptions:
        unknown = set(config.kv_connector_extra_config) - KEYS
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown keys {sorted(unknown)}; known: {', '.join(sorted(KEYS))}"
            )
        options = cls(
            host=config.option("side_channel_host", cls.host, str),
            port=config.option("side_channel_port", cls.port, int),
            lease_s=config.option("kv_lease_s", cls.lease_s, float),
            timeout_s=config.option("kv_transfer_timeout_s", cls.timeout_s, float),
            load_failure_policy=config.option("kv_load_failure_policy", cls.load_failure_policy, str),
            backends=tuple(config.option("backends", list(cls.backends), list)),
            secret_file=config.option("secret_file", None, str),
        )
        if options.load_failure_policy not in POLICIES:
            raise ValueError(f"kv_connector_extra_config.kv_load_failure_policy must be one of {POLICIES}")
        if options.lease_s <= 0 or options.timeout_s <= 0:
            raise ValueError("kv_connector_extra_config.kv_lease_s and kv_transfer_timeout_s must be positive")
        return options
