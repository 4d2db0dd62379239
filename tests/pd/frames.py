"""Raw side-channel exchanges for tests that play a hostile client: send any bytes, read whatever comes back."""

from __future__ import annotations

import json
import socket

from hybridkv.connectors.pd import side_channel


def exchange(port: int, frame: bytes) -> bytes:
    """Send `frame` to the side channel on loopback and read until it closes. A server that closes with our bytes
    unread resets the connection: that ends in b"<reset>", a refusal too."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(frame)
        chunks = []
        try:
            while chunk := conn.recv(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:
            chunks.append(b"<reset>")
    return b"".join(chunks)


def refused(reply: bytes) -> bool:
    """The one generic refusal (or a reset): nothing about the instance."""
    body = reply.removesuffix(b"<reset>")
    return body == b"" or body.endswith(json.dumps(side_channel.REFUSED).encode())
