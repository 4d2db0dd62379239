"""hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models."""

__version__ = "0.1.0"
