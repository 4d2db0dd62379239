"""Connectors move KV between this engine and the outside: NixlConnector (prefill/decode disaggregation),
OffloadingConnector (CPU memory and disk tiers)."""

from hybridkv.connectors import (
    nixl_connector,  # noqa: F401  (registers itself)
    offload_connector,  # noqa: F401  (registers itself)
)
