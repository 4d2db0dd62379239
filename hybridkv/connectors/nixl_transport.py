"""NIXL (UCX underneath): register KV buffers, exchange agent metadata, READ descriptor lists from a peer.

The agent runs without NIXL's progress thread (which spins a core per instance even when idle): the initiator
drives its transfers by polling their state from the engine loop, and the target side calls `progress()` from
its engine loop only while it holds leases (a peer may be reading), so an idle instance wakes for nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.connectors.descriptors import Descriptors


def _nixl() -> tuple[Any, Any]:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ValueError("NixlConnector needs NIXL: pip install nixl-cu12 (or hybridkv[pd])") from e
    return nixl_agent, nixl_agent_config


def mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


class NixlTransport:
    def __init__(self, name: str, backends: list[str] | None = None) -> None:
        nixl_agent, nixl_agent_config = _nixl()
        config = nixl_agent_config(enable_prog_thread=False, backends=backends or ["UCX"])
        self.name = name
        self.agent = nixl_agent(name, config)
        self.mem = "DRAM"
        self.device_id = 0

    def register(self, buffers: list[torch.Tensor]) -> None:
        """Each KV buffer once, as one region (descriptors address ranges inside them)."""
        if buffers:
            self.mem = mem_type(buffers[0].device)
            self.device_id = buffers[0].device.index or 0
        for b in buffers:
            self.agent.register_memory(b)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_remote_agent(metadata)

    def read(self, descs: Descriptors, peer: str) -> Any:
        """Start a READ of `descs.remote` (the peer's memory) into `descs.local`; returns a handle to poll."""
        local = self.agent.get_xfer_descs(descs.local, self.mem)
        remote = self.agent.get_xfer_descs(descs.remote, self.mem)
        handle = self.agent.initialize_xfer("READ", local, remote, peer)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL could not start a read from {peer}")
        return handle

    def state(self, handle: Any) -> str:
        """DONE, PROC or ERR. Polling also progresses the transfer."""
        return self.agent.check_xfer_state(handle)

    def progress(self) -> None:
        """Drive UCX on the target side: without NIXL's progress thread, a peer's READ of our memory advances
        only while we call into the agent."""
        self.agent.get_new_notifs()

    def release(self, handle: Any) -> bool:
        """Free a finished transfer, or cancel one in flight; False if NIXL refused (still running)."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False
