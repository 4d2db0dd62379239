"""The PD side channel: one JSON request and one JSON reply per TCP connection.

The listener blocks in accept() on its own thread, so an idle instance costs no CPU. Handlers run on that thread
and must be quick (they only read metadata or update a lease table under a lock).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_MESSAGE = 16 << 20


class SideChannelServer:
    def __init__(self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"the KV side channel port {host}:{port} is in use: give each instance its own "
                    "kv_connector_extra_config.side_channel_port"
                ) from e
            raise ValueError(f"cannot listen on the KV side channel {host}:{port}: {e}") from e
        self.host, self.port = host, self.sock.getsockname()[1]
        self.handler = handler
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="hybridkv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5)
                    reply = self.handler(_read(conn))
                except Exception as e:  # a bad peer must not stop the listener
                    logger.warning("side channel: bad request: %s", e)
                    reply = {"ok": False, "error": f"bad request: {e}"}
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self._stopped = True
        self.sock.close()


def request(host: str, port: int, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one request, return the reply. Raises ConnectionError with the peer's address on any failure."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(json.dumps(message).encode() + b"\n")
            return _read(conn)
    except (OSError, ValueError) as e:
        raise ConnectionError(f"KV side channel {host}:{port}: {e}") from e


def _read(conn: socket.socket) -> dict[str, Any]:
    chunks, size = [], 0
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > MAX_MESSAGE:
            raise ValueError("message too large")
    data = json.loads(b"".join(chunks) or b"null")
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data
