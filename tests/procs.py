"""Real processes for end-to-end tests: servers and proxies on free loopback ports, logs in files (the product's
launcher, hybridkv/launch.py, which `hybridkv bench pd-accuracy` uses too)."""

from hybridkv.launch import Process, free_port, together, wait_healthy

__all__ = ["Process", "free_port", "together", "wait_healthy"]
