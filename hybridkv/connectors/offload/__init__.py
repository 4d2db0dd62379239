"""OffloadingConnector: KV blocks stored to CPU memory and disk, keyed by prefix hash, loaded instead of recomputed."""
