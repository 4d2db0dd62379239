"""Connectors move KV between this engine and the outside: NixlConnector (prefill/decode disaggregation)."""

from hybridkv.connectors import nixl_connector  # noqa: F401  (registers itself)
