"""The PD side channel: one authenticated request and one authenticated reply per TCP connection.

A frame is a fixed header, then `length` bytes of encrypted JSON:

    magic "HKVS" | version u8 | kind u8 (1 request, 2 reply) | length u32 | nonce 16 B | timestamp f64 | MAC 32 B

The payload is encrypted with a keystream of (cipher key, nonce), so the NIXL metadata a handshake returns (memory
keys that let its holder read and write KV) cannot be sniffed; MAC = HMAC-SHA256(channel key, header fields, bound
nonce, encrypted payload), and a reply is bound to its request's nonce, so it answers that request only. The
server checks length, MAC, timestamp and nonce (no replays) before it decrypts and parses the payload; a request
that fails any of them gets one generic refusal, unsigned, that says nothing about this instance. This file holds
the frames and the client; the server is `side_channel_server.py`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from typing import Any

from hybridkv.connectors.mesh_auth import MAC_BYTES, NONCE_BYTES, MeshKeys, mac, mac_ok, xor_stream

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"HKVS", 1
REQUEST, REPLY = 1, 2
_HEAD = struct.Struct("<4sBBI16sd")
FRAME_HEADER = _HEAD.size + MAC_BYTES
MAX_PAYLOAD = 1 << 20
MAX_DEPTH = 6  # of the JSON payload: our messages nest 4 deep at most
REFUSED = {"ok": False, "error": "refused"}


class ProtocolError(ValueError):
    """A frame that is malformed, too large, unauthenticated, stale or replayed."""


class MalformedReply(ConnectionError):
    """A reply that authenticated but does not parse: the peer was reached and holds the secret (as opposed to a
    plain ConnectionError: not reached, silent, or not a mesh member)."""


def encode(keys: MeshKeys, kind: int, message: dict[str, Any], bound: bytes = b"", nonce: bytes | None = None) -> bytes:
    nonce = nonce or os.urandom(NONCE_BYTES)
    payload = xor_stream(keys.cipher, nonce, json.dumps(message, separators=(",", ":")).encode())
    head = _HEAD.pack(MAGIC, VERSION, kind, len(payload), nonce, time.time())
    return head + mac(keys.channel, head, bound, payload) + payload


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


def parse_header(raw: bytes, kind: int) -> tuple[bytes, bytes, float, bytes, int]:
    """(header fields, nonce, timestamp, MAC, payload length) of a frame's first FRAME_HEADER bytes; the kind,
    version and length are checked, nothing else."""
    head, tag = raw[: _HEAD.size], raw[_HEAD.size :]
    magic, version, got_kind, length, nonce, ts = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or got_kind != kind:
        raise ProtocolError("not a hybridkv side-channel frame of this kind and version")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes is over the {MAX_PAYLOAD} limit")
    return head, nonce, ts, tag, length


def read_frame(conn: socket.socket, deadline: float, kind: int) -> tuple[bytes, bytes, float, bytes, bytes]:
    """(header, nonce, timestamp, MAC, payload) of a frame of `kind`, read before `deadline`; nothing verified."""
    head, nonce, ts, tag, length = parse_header(_recv_exact(conn, FRAME_HEADER, deadline), kind)
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


def request(host: str, port: int, message: dict[str, Any], keys: MeshKeys, timeout: float = 5.0) -> dict[str, Any]:
    """Send one request, return its verified reply. Raises ConnectionError naming the peer on any failure,
    a refusal included (MalformedReply where the reply authenticated but did not parse)."""
    nonce = os.urandom(NONCE_BYTES)
    deadline = time.monotonic() + timeout
    authenticated = False
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
            authenticated = True
            return decode_payload(xor_stream(keys.cipher, reply_nonce, payload))
    except (OSError, ValueError, OverflowError) as e:
        error = MalformedReply if authenticated else ConnectionError
        raise error(f"KV side channel {host}:{port}: {e}") from e
