"""SideChannelServer: the prefill instance's side of the side channel, on one asyncio loop in its own thread.

Each connection may take CONNECTION_DEADLINE_S to deliver one whole request frame. An idle or slow connection costs
a socket, not a thread, and when MAX_CONNECTIONS are open a new one evicts the oldest connection whose frame is
still incomplete. A mesh peer sends its frame in one piece and is answered within a millisecond, so no number of
idle, dripping or reconnecting clients keeps it out. A request that fails its length, MAC, timestamp or nonce
check gets the one generic, unsigned refusal (without a mesh secret nonces are not recorded: anyone could fill the
table, and anyone can make a fresh message anyway). The loop sleeps in epoll when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hybridkv.connectors.mesh_auth import MAC_BYTES, NONCE_BYTES, MeshKeys, ReplayGuard, mac_ok, xor_stream
from hybridkv.connectors.pd.side_channel import (
    _HEAD,
    FRAME_HEADER,
    MAGIC,
    REFUSED,
    REPLY,
    REQUEST,
    VERSION,
    ProtocolError,
    decode_payload,
    encode,
    parse_header,
)

logger = logging.getLogger(__name__)

CONNECTION_DEADLINE_S = 3.0  # to deliver one whole request (they are < 4 KiB)
MAX_CONNECTIONS = 256  # open at once; past it the oldest incomplete one is dropped
_QUIET_S = 10.0  # at most one refusal warning per this long
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelServer:
    """Serves `handler(message) -> reply` for authenticated requests. The handler runs on the server's loop thread:
    it must be thread-safe and quick (it reads metadata or updates a locked lease table)."""

    def __init__(self, host: str, port: int, handler: Handler, keys: MeshKeys) -> None:
        try:
            self.sock = socket.create_server((host, port), reuse_port=False, backlog=512)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"the KV side channel port {host}:{port} is in use: give each instance its own "
                    "kv_connector_extra_config.side_channel_port"
                ) from e
            raise ValueError(f"cannot listen on the KV side channel {host}:{port}: {e}") from e
        self.host, self.port = host, self.sock.getsockname()[1]
        self.handler, self.keys = handler, keys
        self.replays = ReplayGuard()
        self.refused_total = 0  # unauthenticated, stale, replayed or malformed requests
        self.busy_total = 0  # incomplete connections dropped to make room for new ones
        self._incomplete: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # oldest first
        self._last_warning = 0.0
        self._stopped = False
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="hybridkv-side-channel", daemon=True)
        self._thread.start()
        started.wait(10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._stopped

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self.sock))
            started.set()
            self._loop.run_forever()
        finally:
            started.set()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._incomplete[writer] = None
        while len(self._incomplete) > MAX_CONNECTIONS:
            oldest = next(iter(self._incomplete))
            del self._incomplete[oldest]
            self.busy_total += 1
            oldest.close()
        peer = writer.get_extra_info("peername")
        nonce = bytes(NONCE_BYTES)
        try:
            try:
                head, nonce, ts, tag, payload = await asyncio.wait_for(self._frame(reader), CONNECTION_DEADLINE_S)
                self._incomplete.pop(writer, None)
                if not mac_ok(self.keys.channel, tag, head, b"", payload):
                    raise ProtocolError("MAC does not verify (no or another mesh secret)")
                # Nonces are recorded only after the MAC verified, and only under a secret (see ReplayGuard).
                fresh = self.replays.fresh(nonce, ts) if self.keys.authenticated else self.replays.in_window(ts)
                if not fresh:
                    raise ProtocolError("stale timestamp or replayed nonce")
                message = decode_payload(xor_stream(self.keys.cipher, nonce, payload))
            except (ProtocolError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                self._refuse(peer, str(e) or type(e).__name__)
                writer.write(_unsigned_refusal(nonce))
            else:
                writer.write(encode(self.keys, REPLY, self._answer(message), bound=nonce))
            await asyncio.wait_for(writer.drain(), CONNECTION_DEADLINE_S)
        except (OSError, asyncio.TimeoutError):
            pass  # the client left or stopped reading
        finally:
            self._incomplete.pop(writer, None)
            writer.close()

    @staticmethod
    async def _frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes, float, bytes, bytes]:
        head, nonce, ts, tag, length = parse_header(await reader.readexactly(FRAME_HEADER), REQUEST)
        return head, nonce, ts, tag, await reader.readexactly(length)

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.handler(message)
        except ValueError as e:
            return {"ok": False, "error": f"bad request: {str(e)[:200]}"}
        except Exception:  # a handler bug must not end this server or leak details
            logger.exception("side channel: handler failed")
            return {"ok": False, "error": "internal error"}

    def _refuse(self, peer: Any, why: str) -> None:
        self.refused_total += 1
        now = time.monotonic()
        if now - self._last_warning > _QUIET_S:
            self._last_warning = now
            logger.warning("side channel: refused a request from %s: %s", peer, why)

    def close(self) -> None:
        self._stopped = True
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(5)
        self.sock.close()

    def _shutdown(self) -> None:
        self._server.close()
        self._loop.stop()


def _unsigned_refusal(nonce: bytes) -> bytes:
    payload = json.dumps(REFUSED).encode()
    return _HEAD.pack(MAGIC, VERSION, REPLY, len(payload), nonce, time.time()) + bytes(MAC_BYTES) + payload
