"""DiskTier: offloaded KV blocks as files in a directory, one file per (block hash, group), kept across restarts.

Layout. Entries live in `<root>/<dir id>/<block hash hex>-g<group>.kv`. Without a mesh secret the dir id is the
first 32 hex digits of the compat hash (model weights, dtype, KV groups), so instances of another model or KV
shape never see the entries; with one it is a keyed id, mac(disk key, "dir", compat hash)[:32], so instances with
different secrets (or none) never share, serve or delete each other's entries. The entry dir is private to this
user (`private_dir.make_private_dir`: 0700, owned by us, not a symlink).

Entry format (version 2, little-endian):

    magic "HKVOFF02" (8) | compat hash (32) | block hash (32) | group (u32) | payload bytes (u64) | tag (32) | payload

    tag = HMAC-SHA256(disk key, len-prefixed(header fields before the tag), len-prefixed(payload))

The disk key comes from the mesh secret (`mesh_auth.MeshKeys.disk`). With a secret the tag proves the entry was
written by an instance holding that secret, for exactly this compat hash, block hash, group and length: a file
planted or altered by anyone else, or moved under another entry's name, fails it. Without a secret the key is
public and the tag is only an integrity checksum against corruption and truncation. Secrecy comes from modes,
not from the tag: entries and temporary files are created 0600 (`O_CREAT|O_EXCL|O_NOFOLLOW`), in a 0700 dir.

Writes go to a temporary file in the same directory and are renamed into place (`os.replace`), so a reader, in
this process or another one sharing the directory, sees a whole entry or none. Reads open only regular files
(`O_NOFOLLOW|O_NONBLOCK`, then `fstat`: a symlink, FIFO or device under an entry's name is never followed or
waited on) and read the header and the payload in one `readv`. An entry that fails any check (wrong magic or
header, wrong size, bad tag: forged, corrupt, truncated, another secret's, an old format) is deleted and counted
(`corrupt`), never served; the load then recomputes. A write that fails (a full disk, a quota) is skipped with
one warning; the tier keeps serving what it has.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import struct
import threading
import time
import uuid
from pathlib import Path

from hybridkv.connectors.mesh_auth import MeshKeys, mac, mac_ok
from hybridkv.connectors.offload.key import Key
from hybridkv.connectors.offload.policy import make_policy
from hybridkv.connectors.private_dir import make_private_dir

logger = logging.getLogger(__name__)

MAGIC = b"HKVOFF02"
FIELDS = struct.Struct("<8s32s32sIQ")  # magic, compat hash, block hash, group, payload bytes
HEADER = struct.Struct("<8s32s32sIQ32s")  # FIELDS, then the tag: mac(disk key, FIELDS bytes, payload)
_NAME = re.compile(r"([0-9a-f]{64})-g([0-9]+)\.kv")
STALE_TMP_S = 3600.0  # a temporary file this old was left by a crashed writer
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def dir_id(compat: str, keys: MeshKeys) -> str:
    """The entry directory's name under the root: keyed with a secret, so that secrets never share one."""
    if not keys.authenticated:
        return compat[:32]
    return mac(keys.disk, b"dir", compat.encode()).hex()[:32]


class DiskTier:
    def __init__(
        self,
        root: str | Path,
        compat: str,
        capacity_bytes: int,
        eviction: str = "lru",
        entry_bytes: int = 1 << 16,
        keys: MeshKeys | None = None,
    ) -> None:
        """`entry_bytes`: a typical payload size; ARC sizes its ghost lists from the entries that fit. `keys`:
        the mesh keys (`MeshKeys.derive(load_secret(...))`); None means no secret (public keys)."""
        if len(compat) != 64:
            raise ValueError("the compatibility hash must be a SHA-256 hex digest")
        self.compat = compat
        self._compat = bytes.fromhex(compat)
        self._keys = keys if keys is not None else MeshKeys.derive(None)
        self.authenticated = self._keys.authenticated
        self.capacity_bytes = capacity_bytes
        self.dir = Path(root) / dir_id(compat, self._keys)
        make_private_dir(Path(root), self.dir)
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
        """Adopt the regular entry files a previous run left, oldest first, and trim them to capacity. Nothing
        is opened: symlinks and special files under an entry's name are removed, never followed."""
        found = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_tmp, m = entry.name.endswith(".tmp"), _NAME.fullmatch(entry.name)
            if not stat.S_ISREG(st.st_mode):
                if m or is_tmp:
                    logger.warning("KV offload: removed %s from %s: not a regular file", entry.name, self.dir)
                    self.corrupt += bool(m)
                    self._unlink(Path(entry.path))
                continue
            if is_tmp:
                if now - st.st_mtime > STALE_TMP_S:
                    self._unlink(Path(entry.path))
                continue
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

    def _fields(self, key: Key, nbytes: int) -> bytes:
        return FIELDS.pack(MAGIC, self._compat, key[0], key[1], nbytes)

    def write(self, key: Key, payload: memoryview) -> bool:
        """Store an entry atomically (an I/O thread). False when it was skipped: too big, or the write failed."""
        payload = memoryview(payload).cast("B")
        size = HEADER.size + payload.nbytes
        with self._lock:
            if key in self._sizes:
                return True
            if size > self.capacity_bytes or not self._make_room(size):
                self.skipped += 1
                return False
            self._reserved += size
        fields = self._fields(key, payload.nbytes)
        header = fields + mac(self._keys.disk, fields, payload)  # one pass over the payload
        path = self._path(key)
        tmp = self.dir / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fd = os.open(tmp, _WRITE, 0o600)
            try:
                f = open(fd, "wb")  # noqa: SIM115 (closed by the with below)
            except BaseException:
                os.close(fd)
                raise
            with f:
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
        e.g. evicted by another instance) or "corrupt" (refused, dropped and counted)."""
        out = memoryview(out).cast("B")
        path = self._path(key)
        try:
            fd = os.open(path, _READ)  # a FIFO opens at once (non-blocking) and is refused below
        except FileNotFoundError:
            with self._lock:
                if key in self._sizes:
                    self.used_bytes -= self._sizes.pop(key)
                    self._policy.remove(key)
            return "missing"
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
                return self._refuse(key, path, "not a regular file")
            logger.warning("KV offload: reading %s failed: %s", path, e)
            return "missing"
        head, extra = bytearray(HEADER.size), bytearray(1)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._refuse(key, path, "not a regular file")
            if st.st_size != HEADER.size + out.nbytes:
                return self._refuse(key, path, f"{st.st_size} bytes, not {HEADER.size + out.nbytes}")
            n = os.readv(fd, [head, out, extra])  # one call; `extra` catches a file that grew
        except OSError as e:
            logger.warning("KV offload: reading %s failed: %s", path, e)
            return "missing"
        finally:
            os.close(fd)
        fields = self._fields(key, out.nbytes)
        if (
            n == HEADER.size + out.nbytes
            and head[: FIELDS.size] == fields
            and mac_ok(self._keys.disk, bytes(head[FIELDS.size :]), fields, out)
        ):
            return "ok"
        return self._refuse(key, path, "failed its header or MAC check")

    def _refuse(self, key: Key, path: Path, why: str) -> str:
        logger.warning("KV offload: dropped disk entry %s (%s)", path.name, why)
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
