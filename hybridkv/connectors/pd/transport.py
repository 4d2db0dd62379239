"""NIXL (UCX underneath): register KV buffers, exchange agent metadata, READ descriptor lists from a peer.

The agent runs without NIXL's progress thread (which spins a core per instance even when idle): the initiator
drives its transfers by polling their state from the engine loop, and the target side calls `progress()` from
its engine loop only while it holds leases (a peer may be reading), so an idle instance wakes for nothing.

UCX opens a TCP listener on every network device it uses. Unless the operator chose devices (UCX_NET_DEVICES),
it is limited to the device that holds the side channel's address (`lo` on loopback), so nothing listens where
the operator did not ask; NIXL's own listener thread stays off.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Any

import torch

from hybridkv.connectors.pd.descriptors import Descriptors


def _nixl() -> tuple[Any, Any]:
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ValueError("NixlConnector needs NIXL: pip install nixl-cu12 (or hybridkv[pd])") from e
    return nixl_agent, nixl_agent_config


logger = logging.getLogger(__name__)
SIOCGIFADDR = 0x8915


def device_of(host: str) -> str | None:
    """The network device that holds address `host` ("lo" for loopback), or None for a wildcard (every device)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError as e:
            raise ValueError(f"side_channel_host {host} does not resolve: {e}") from e
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        if _addresses(name, addr.version) & {addr}:
            return name
    raise ValueError(f"side_channel_host {host} is not an address of this machine")


def _addresses(device: str, version: int) -> set[Any]:
    if version == 6:
        with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
            return {ipaddress.ip_address(bytes.fromhex(line.split()[0])) for line in f if line.split()[-1] == device}
        return set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", device.encode()[:15]))
        except OSError:  # no IPv4 address on this device
            return set()
    return {ipaddress.ip_address(packed[20:24])}


def bind_ucx_to(host: str) -> None:
    """Limit UCX's devices to the one serving `host`, unless the operator set UCX_NET_DEVICES. Process-wide: UCX
    reads its environment when an agent is created."""
    if "UCX_NET_DEVICES" in os.environ:
        logger.info("UCX_NET_DEVICES=%s (set by the operator)", os.environ["UCX_NET_DEVICES"])
        return
    device = device_of(host)
    if device is not None:
        os.environ["UCX_NET_DEVICES"] = device


def mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


class NixlTransport:
    def __init__(self, name: str, backends: list[str] | None = None, bind_host: str = "127.0.0.1") -> None:
        nixl_agent, nixl_agent_config = _nixl()
        bind_ucx_to(bind_host)
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=backends or ["UCX"])
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
