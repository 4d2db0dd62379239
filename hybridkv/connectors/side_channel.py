"""The PD side channel: one authenticated request and one authenticated reply per TCP connection.

A frame is a fixed header, then `length` bytes of encrypted JSON:

    magic "HKVS" | version u8 | kind u8 (1 request, 2 reply) | length u32 | nonce 16 B | timestamp f64 | MAC 32 B

The payload is encrypted with a keystream of (cipher key, nonce), so the NIXL metadata a handshake returns (memory
keys that let its holder read and write KV) cannot be sniffed; MAC = HMAC-SHA256(channel key, header fields, bound
nonce, encrypted payload), and a reply is bound to its request's nonce, so it answers that request only. The
server checks length, MAC, timestamp and nonce (no replays) before it decrypts and parses the payload; a request
that fails any of them gets one generic refusal, unsigned, that says nothing about this instance. Each connection
runs on its own thread with one deadline for the whole request, at most MAX_CONNECTIONS at once, so a slow or
silent client delays no one else.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hybridkv.connectors.mesh_auth import MAC_BYTES, NONCE_BYTES, MeshKeys, ReplayGuard, mac, mac_ok, xor_stream

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"HKVS", 1
REQUEST, REPLY = 1, 2
_HEAD = struct.Struct("<4sBBI16sd")
FRAME_HEADER = _HEAD.size + MAC_BYTES
MAX_PAYLOAD = 1 << 20
MAX_DEPTH = 6  # of the JSON payload: our messages nest 4 deep at most
CONNECTION_DEADLINE_S = 3.0  # to read a whole request (they are < 4 KiB)
MAX_CONNECTIONS = 64
REFUSED = {"ok": False, "error": "refused"}
_QUIET_S = 10.0  # at most one refusal warning per this long


class ProtocolError(ValueError):
    """A frame that is malformed, too large, unauthenticated, stale or replayed."""


def encode(keys: MeshKeys, kind: int, message: dict[str, Any], bound: bytes = b"", nonce: bytes | None = None) -> bytes:
    nonce = nonce or os.urandom(NONCE_BYTES)
    payload = xor_stream(keys.cipher, nonce, json.dumps(message, separators=(",", ":")).encode())
    head = _HEAD.pack(MAGIC, VERSION, kind, len(payload), nonce, time.time())
    return head + mac(keys.channel, head, bound, payload) + payload


def _unsigned(kind: int, message: dict[str, Any], nonce: bytes) -> bytes:
    payload = json.dumps(message).encode()
    return _HEAD.pack(MAGIC, VERSION, kind, len(payload), nonce, time.time()) + bytes(MAC_BYTES) + payload


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError("timed out (the deadline passed)")
        conn.settimeout(left)
        try:
            chunk = conn.recv(min(n - len(buf), 1 << 16))
        except TimeoutError as e:
            raise ProtocolError("timed out (the deadline passed)") from e
        if not chunk:
            raise ProtocolError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def read_frame(conn: socket.socket, deadline: float, kind: int) -> tuple[bytes, bytes, float, bytes, bytes]:
    """(header, nonce, timestamp, MAC, payload) of a frame of `kind`, read before `deadline`; nothing verified."""
    raw = _recv_exact(conn, FRAME_HEADER, deadline)
    head, tag = raw[: _HEAD.size], raw[_HEAD.size :]
    magic, version, got_kind, length, nonce, ts = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or got_kind != kind:
        raise ProtocolError("not a hybridkv side-channel frame of this version")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes is over the {MAX_PAYLOAD} limit")
    return head, nonce, ts, tag, _recv_exact(conn, length, deadline)


def decode_payload(payload: bytes) -> dict[str, Any]:
    """JSON object of bounded depth (json recurses: a deep payload must not reach the recursion limit)."""
    depth = 0
    for byte in payload:  # brackets inside strings count too: only over-counts, never misses nesting
        if byte in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH}")
        elif byte in b"]}":
            depth -= 1
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"payload is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ProtocolError("payload is not a JSON object")
    return data


class SideChannelServer:
    """Serves `handler(message) -> reply` for authenticated requests. The handler runs on the connection's thread,
    so it must be thread-safe and quick (it reads metadata or updates a locked lease table)."""

    def __init__(
        self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]], keys: MeshKeys
    ) -> None:
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
        self.handler, self.keys = handler, keys
        self.replays = ReplayGuard()
        self.refused_total = 0  # unauthenticated, stale, replayed or malformed requests
        self.busy_total = 0  # connections closed at once because MAX_CONNECTIONS were open
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._last_warning = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="hybridkv-side-channel", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._stopped

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, peer = self.sock.accept()
            except OSError as e:
                if self._stopped or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed: /health reports this thread dead unless close() was called
                time.sleep(0.01)  # e.g. out of file descriptors: try again, never stop listening
                continue
            if not self._slots.acquire(blocking=False):
                self.busy_total += 1
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()
            except RuntimeError:  # cannot start a thread: drop this connection, keep listening
                self._slots.release()
                conn.close()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            with conn:
                deadline = time.monotonic() + CONNECTION_DEADLINE_S
                nonce = bytes(NONCE_BYTES)
                try:
                    head, nonce, ts, tag, payload = read_frame(conn, deadline, REQUEST)
                    if not mac_ok(self.keys.channel, tag, head, b"", payload):
                        raise ProtocolError("MAC does not verify (no or another mesh secret)")
                    if not self.replays.fresh(nonce, ts):
                        raise ProtocolError("stale timestamp or replayed nonce")
                    message = decode_payload(xor_stream(self.keys.cipher, nonce, payload))
                except (ProtocolError, OSError) as e:
                    self._refuse(peer, str(e))
                    with contextlib.suppress(OSError):
                        conn.sendall(_unsigned(REPLY, REFUSED, nonce))
                    return
                try:
                    reply = self.handler(message)
                except ValueError as e:
                    reply = {"ok": False, "error": f"bad request: {str(e)[:200]}"}
                except Exception:  # a handler bug must not end this thread's caller or leak details
                    logger.exception("side channel: handler failed")
                    reply = {"ok": False, "error": "internal error"}
                with contextlib.suppress(OSError):
                    conn.settimeout(max(0.01, deadline - time.monotonic()))
                    conn.sendall(encode(self.keys, REPLY, reply, bound=nonce))
        finally:
            self._slots.release()

    def _refuse(self, peer: Any, why: str) -> None:
        self.refused_total += 1
        now = time.monotonic()
        if now - self._last_warning > _QUIET_S:
            self._last_warning = now
            logger.warning("side channel: refused a request from %s: %s", peer, why)

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self.sock.close()


def request(host: str, port: int, message: dict[str, Any], keys: MeshKeys, timeout: float = 5.0) -> dict[str, Any]:
    """Send one request, return its verified reply. Raises ConnectionError naming the peer on any failure,
    a refusal included."""
    nonce = os.urandom(NONCE_BYTES)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(encode(keys, REQUEST, message, nonce=nonce))
            head, reply_nonce, _, tag, payload = read_frame(conn, deadline, REPLY)
            if not mac_ok(keys.channel, tag, head, nonce, payload):
                refused = tag == bytes(MAC_BYTES) and payload == json.dumps(REFUSED).encode()
                raise ProtocolError(
                    "refused the request (a missing or different mesh secret, or a stale clock)"
                    if refused
                    else "its reply does not authenticate"
                )
            return decode_payload(xor_stream(keys.cipher, reply_nonce, payload))
    except (OSError, ValueError, OverflowError) as e:
        raise ConnectionError(f"KV side channel {host}:{port}: {e}") from e
