"""Connectors move KV between this engine and the outside.

- `base`: the interface every connector implements, and the registry `--kv-transfer-config` names one from.
- `identity`: what two engines (or an engine and a disk tier) must share to exchange KV: the model fingerprint and
  the compat hash of the KV plan.
- `mesh_auth`, `private_dir`: the mesh secret and its keys, private directories (PD and the disk tier use both;
  the ownership checks are `hybridkv/ownership.py`, shared with the native kernel loader).
- `pd/`: NixlConnector, prefill/decode disaggregation.
- `offload/`: OffloadingConnector, CPU memory and disk tiers.

Each connector registers itself when its module loads; `base.connector_factory` loads it when a config names it.
"""
