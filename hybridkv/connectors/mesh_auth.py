"""The PD mesh secret and what it keys: side-channel MACs and encryption, kv_transfer_params signatures, disk-tier
entries.

Every instance of one mesh (prefill and decode instances, and the disk tier they share) holds the same secret,
from `kv_connector_extra_config.secret_file` (a file only its owner can read) or the environment variable
HYBRIDKV_KV_SECRET. One key per purpose is derived from it, so a MAC made for one purpose never verifies for
another. Without a secret the same code runs with public keys: MACs are then checksums that anyone can make, which
is why a side channel without a secret must stay on loopback (see README, "Trust model").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

SECRET_ENV = "HYBRIDKV_KV_SECRET"
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
NONCE_BYTES = 16
REPLAY_WINDOW_S = 60.0  # a message's timestamp may differ this much from our clock (hosts need NTP)
MAX_NONCES = 1 << 18  # nonces remembered within the window; past it new messages are refused, not old ones forgotten


def load_secret(secret_file: str | None = None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The mesh secret: `secret_file` if given, else $HYBRIDKV_KV_SECRET, else None. A file must be a regular file
    owned by this user and readable by nobody else; the secret must have at least 16 bytes."""
    env = os.environ if env is None else env
    if secret_file is not None:
        secret = _read_private_file(secret_file)
        where = f"secret_file {secret_file}"
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].encode()
        where = f"${SECRET_ENV}"
    else:
        return None
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the KV mesh secret ({where}) has {len(secret)} bytes; use at least {MIN_SECRET_BYTES}, e.g. "
            "`head -c 32 /dev/urandom | base64 > FILE`"
        )
    return secret


def _read_private_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"kv_connector_extra_config.secret_file {path}: {e.strerror} (a symlink is refused)") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"kv_connector_extra_config.secret_file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"kv_connector_extra_config.secret_file {path} belongs to uid {st.st_uid}, not to us")
        if st.st_mode & 0o077:
            raise ValueError(
                f"kv_connector_extra_config.secret_file {path} is readable by others "
                f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(1 << 16)
    finally:
        os.close(fd)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts: no two different part lists give the same input."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def mac_ok(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(tag, mac(key, *parts))


@dataclass(frozen=True)
class MeshKeys:
    """One key per purpose. `authenticated` is False when there is no secret: the keys are then public."""

    channel: bytes = field(repr=False)  # side-channel MACs
    cipher: bytes = field(repr=False)  # side-channel payload encryption (NIXL metadata carries memory keys)
    params: bytes = field(repr=False)  # kv_transfer_params a prefill instance hands out
    disk: bytes = field(repr=False)  # disk-tier entries
    authenticated: bool = False

    @staticmethod
    def derive(secret: bytes | None) -> MeshKeys:
        root = secret or b""
        return MeshKeys(
            channel=mac(root, b"hybridkv side channel v1"),
            cipher=mac(root, b"hybridkv side channel cipher v1"),
            params=mac(root, b"hybridkv kv_transfer_params v1"),
            disk=mac(root, b"hybridkv disk tier v1"),
            authenticated=secret is not None,
        )


def xor_stream(key: bytes, nonce: bytes, data: bytes) -> bytes:
    """`data` XOR a SHAKE-256 keystream of (key, nonce): encrypts and decrypts. A nonce must never repeat under
    one key (ours are 128-bit random per message); integrity comes from the MAC over the result."""
    if not data:
        return data
    stream = hashlib.shake_256(len(key).to_bytes(2, "little") + key + nonce).digest(len(data))
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(len(data), "little")


class ReplayGuard:
    """Refuses a message whose timestamp is outside the window or whose nonce was seen within it. Invariant: a
    nonce is recorded only for a message whose MAC verified under a secret key (`fresh`), so only mesh members can
    fill the table (at most `max_nonces`; past it new messages are refused). Without a secret a MAC is a checksum
    anyone can make: there the server checks only the timestamp (`in_window`), since a replay gains nothing a new
    message would not, and a table would be anyone's to fill. Thread-safe."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        self.window_s, self.max_nonces = window_s, max_nonces
        self._seen: dict[bytes, float] = {}  # nonce -> when it was seen (insertion order = time order)
        self._lock = threading.Lock()

    def in_window(self, timestamp: float) -> bool:
        return abs(time.time() - timestamp) <= self.window_s  # False for NaN too

    def fresh(self, nonce: bytes, timestamp: float) -> bool:
        """In the window and never seen: records the nonce. Call only once the message's MAC verified."""
        now = time.time()
        if not abs(now - timestamp) <= self.window_s:  # also refuses NaN
            return False
        with self._lock:
            while self._seen:
                oldest, seen = next(iter(self._seen.items()))
                if now - seen <= self.window_s:
                    break
                del self._seen[oldest]
            if nonce in self._seen or len(self._seen) >= self.max_nonces:
                return False
            self._seen[nonce] = now
            return True
