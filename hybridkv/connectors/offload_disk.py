"""DiskTier: offloaded KV blocks as files in a directory, one file per (block hash, group), kept across restarts.

Entries live in `<root>/<compat hash prefix>/`, so instances of another model or KV shape never see them. A file
is a fixed header (magic, full compat hash, block hash, group, payload length, SHA-256 of the payload) and the
payload. Writes go to a temporary file in the same directory and are renamed into place (`os.replace`), so a
reader, in this process or another one sharing the directory, sees a whole entry or none. Every read checks
the header and the checksum: a corrupt or truncated entry is deleted and counted, never served. A write that
fails (a full disk, a quota) is skipped with one warning; the tier keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import struct
import threading
import time
import uuid
from pathlib import Path

from hybridkv.connectors.offload_policy import make_policy
from hybridkv.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

Key = tuple[BlockHash, int]  # (block hash, group id)
MAGIC = b"HKVOFF01"
HEADER = struct.Struct("<8s32s32sIQ32s")  # magic, compat hash, block hash, group, payload bytes, sha256(payload)
_NAME = re.compile(r"^([0-9a-f]{64})-g([0-9]+)\.kv$")
STALE_TMP_S = 3600.0  # a temporary file this old was left by a crashed writer


class DiskTier:
    def __init__(
        self, root: str | Path, compat: str, capacity_bytes: int, eviction: str = "lru", entry_bytes: int = 1 << 16
    ) -> None:
        """`entry_bytes`: a typical payload size; ARC sizes its ghost lists from the entries that fit."""
        if len(compat) != 64:
            raise ValueError("the compatibility hash must be a SHA-256 hex digest")
        self.compat = compat
        self.capacity_bytes = capacity_bytes
        self.dir = Path(root) / compat[:32]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot use {root} for the disk offload tier: {e}") from e
        self._sizes: dict[Key, int] = {}  # resident entries -> file size
        self._policy = make_policy(eviction, max(1, capacity_bytes // (HEADER.size + entry_bytes)))
        self._lock = threading.Lock()
        self.used_bytes = 0  # resident entries
        self._reserved = 0  # writes in flight
        self.evictions = 0
        self.corrupt = 0
        self.skipped = 0
        self._warned = False
        self._scan()

    def _path(self, key: Key) -> Path:
        return self.dir / f"{key[0].hex()}-g{key[1]}.kv"

    def _scan(self) -> None:
        """Adopt the entries a previous run left, oldest first, and trim them to capacity."""
        found = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:
                    self._unlink(Path(entry.path))
                continue
            m = _NAME.match(entry.name)
            if m:
                found.append((st.st_mtime, (bytes.fromhex(m.group(1)), int(m.group(2))), st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._policy.insert(key)
            self.used_bytes += size
        with self._lock:
            self._make_room(0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._sizes

    def touch(self, key: Key) -> bool:
        with self._lock:
            if key not in self._sizes:
                return False
            self._policy.touch(key)
            return True

    def _make_room(self, nbytes: int) -> bool:
        """Evict until `nbytes` more fit (under the lock). False when they cannot."""
        while self.used_bytes + self._reserved + nbytes > self.capacity_bytes:
            victim = self._policy.evict(lambda k: True)
            if victim is None:
                return False
            self._forget(victim)
            self.evictions += 1
        return True

    def _forget(self, key: Key) -> None:
        self.used_bytes -= self._sizes.pop(key)
        self._unlink(self._path(key))

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):  # already gone (another instance evicted it): nothing to serve
            path.unlink()

    def write(self, key: Key, payload: memoryview) -> bool:
        """Store an entry atomically (an I/O thread). False when it was skipped: too big, or the write failed."""
        size = HEADER.size + payload.nbytes
        with self._lock:
            if key in self._sizes:
                return True
            if size > self.capacity_bytes or not self._make_room(size):
                self.skipped += 1
                return False
            self._reserved += size
        digest = hashlib.sha256(payload).digest()
        header = HEADER.pack(MAGIC, bytes.fromhex(self.compat), key[0], key[1], payload.nbytes, digest)
        path = self._path(key)
        tmp = self.dir / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self._unlink(tmp)
            with self._lock:
                self._reserved -= size
                self.skipped += 1
            if not self._warned:
                self._warned = True
                logger.warning("KV offload: writing to %s failed (%s); skipping disk stores that fail", self.dir, e)
            return False
        with self._lock:
            self._reserved -= size
            if key not in self._sizes:
                self._sizes[key] = size
                self._policy.insert(key)
                self.used_bytes += size
        return True

    def read(self, key: Key, out: memoryview) -> str:
        """Fill `out` (exactly the payload's length) with a verified entry. Returns "ok", "missing" (gone,
        e.g. evicted by another instance) or "corrupt" (dropped and counted)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                ok = len(head) == HEADER.size
                if ok:
                    magic, compat, block_hash, group, length, digest = HEADER.unpack(head)
                    ok = (magic, compat, block_hash, group, length) == (
                        MAGIC,
                        bytes.fromhex(self.compat),
                        key[0],
                        key[1],
                        out.nbytes,
                    )
                ok = ok and f.readinto(out) == out.nbytes and not f.read(1)
        except FileNotFoundError:
            with self._lock:
                if key in self._sizes:
                    self.used_bytes -= self._sizes.pop(key)
                    self._policy.remove(key)
            return "missing"
        except OSError as e:
            logger.warning("KV offload: reading %s failed: %s", path, e)
            return "missing"
        if ok and hashlib.sha256(out).digest() == digest:
            return "ok"
        logger.warning("KV offload: dropped corrupt entry %s", path.name)
        with self._lock:
            self.corrupt += 1
            if key in self._sizes:
                self._policy.remove(key)
                self._forget(key)
            else:
                self._unlink(path)
        return "corrupt"

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(self._sizes.values()), "disk tier byte count is off"
            assert len(self._policy) == len(self._sizes), "the eviction policy and the entries disagree"
            assert self.used_bytes <= self.capacity_bytes, "disk tier over capacity"
