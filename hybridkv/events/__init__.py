"""KV cache events for KV-aware routers, in vLLM's wire format (`--kv-events-config`).

- `config`: KVEventsConfig, vLLM's JSON keys.
- `wire`: the msgpack batch (hashes, parent, tokens, block size, group, medium).
- `publisher`: ZmqEventPublisher, the PUB socket, the replay ROUTER socket and the thread that owns them.

The records come from the KV core (`hybridkv.kv.events`) and the offload tiers; the engine drains them after
every step and publishes one batch per step that changed a cache.
"""
