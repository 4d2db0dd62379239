"""Identity: what two engines (PD peers) or an engine and its disk tier must share to exchange KV blocks.

A checkpoint's identity: peers that exchange KV must run the same weights, not just shapes.

`model_fingerprint` is a SHA-256 over every byte of config.json, every `*.safetensors` file and its index, and the
tokenizer files that define token ids (those of `TOKENIZER_FILES` present), each framed by its length-prefixed name
and its size, so no byte can move across a file boundary. Files are hashed in 8 MiB chunks, in parallel per file.

Hashing a large checkpoint takes a while, so the digest is cached in `<model_dir>/.hybridkv-fingerprint.json` or,
when the folder is not writable, `$XDG_CACHE_HOME/hybridkv/fingerprints/<sha256 of its realpath>.json`. An entry
is keyed on the exact set of hashed files and each one's (size, mtime_ns, ctime_ns, inode, device). The change
time is the key that matters: a rewrite in place that restores the mtime (`os.utime`, `touch -d`, a careless copy
tool) still moves the ctime, which no unprivileged call can set back, so no rewrite keeps a stale digest. An entry
is trusted only if it is a regular file (not followed through a symlink) owned by us, not group/other-writable, and
of the expected shape; otherwise it is recomputed and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridkv.kv.plan import KVPlan

logger = logging.getLogger(__name__)

VERSION = 1  # of the digest: a new one changes every model's fingerprint
CACHE_VERSION = 2  # of cache entries; 2: keyed on ctime_ns and device too (1 trusted a rewrite restoring the mtime)
COMPAT_VERSION = 2  # 2: specs describe themselves (recurrent states), dtype names without "torch."
CACHE_NAME = ".hybridkv-fingerprint.json"
CHUNK = 8 << 20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
_warned_no_cache = False

Stats = list[dict[str, int | str]]  # per hashed file: name, size, mtime_ns, ctime_ns, ino, dev


def _files(folder: Path) -> list[Path]:
    names = ["config.json", "model.safetensors.index.json", *TOKENIZER_FILES]
    found = [folder / n for n in names if (folder / n).is_file()]
    return sorted(found + [p for p in folder.glob("*.safetensors") if p.is_file()], key=lambda p: p.name)


def _stats(files: list[Path]) -> Stats:
    out: Stats = []
    for p in files:
        st = p.stat()  # follows links: a hub snapshot's files are links into its blob store
        out.append({"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                    "ino": st.st_ino, "dev": st.st_dev})  # fmt: skip
    return out


def _hash_file(path: Path) -> bytes:
    h, buf = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


def _digest(files: list[Path], stats: Stats) -> str:
    with ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1, 8))) as pool:
        contents = list(pool.map(_hash_file, files))  # hashlib drops the GIL on large updates
    h = hashlib.sha256(b"hybridkv-model-fingerprint-v%d\0" % VERSION)
    for st, content in zip(stats, contents):
        name = str(st["name"]).encode()
        h.update(len(name).to_bytes(8, "big") + name + int(st["size"]).to_bytes(8, "big") + content)
    return h.hexdigest()


def _cache_paths(folder: Path) -> list[Path]:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(os.path.realpath(folder).encode()).hexdigest()
    return [folder / CACHE_NAME, base / "hybridkv" / "fingerprints" / f"{key}.json"]


def _read_cache(path: Path, stats: Stats) -> str | None:
    """The cached digest if `path` is a trustworthy entry for exactly these files, else None (never raises)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return None
            entry = json.loads(f.read(16 << 20))
        digest = entry["digest"]
        ok = entry["version"] == CACHE_VERSION and entry["files"] == stats and isinstance(digest, str)
        return digest if ok and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_cache(path: Path, entry: dict, make_dir: bool) -> None:
    """Atomically (temp file + rename in the same folder), mode 0600; raises OSError if the folder is not writable."""
    if make_dir:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hybridkv-fingerprint.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)  # replaces a link at `path`, never writes through it
    except BaseException:
        os.unlink(tmp)
        raise


def model_fingerprint(model_dir: str | Path) -> str:
    """Hex SHA-256 identifying the checkpoint in `model_dir` (see the module docstring for what it covers)."""
    global _warned_no_cache
    folder = Path(model_dir)
    files = _files(folder)
    stats = _stats(files)
    caches = _cache_paths(folder)
    for path in caches:
        if (digest := _read_cache(path, stats)) is not None:
            return digest
    gib = sum(int(s["size"]) for s in stats) / (1 << 30)
    logger.info("fingerprinting %s: hashing %.2f GiB in %d files (once; cached afterwards)", folder, gib, len(files))
    start = time.perf_counter()
    digest = _digest(files, stats)
    took = time.perf_counter() - start
    logger.info("fingerprinted %s in %.1f s (%.2f GiB/s)", folder, took, gib / max(took, 1e-9))
    if _stats(files) != stats:
        logger.warning("%s changed while it was being fingerprinted: not caching the result", folder)
        return digest
    entry = {"version": CACHE_VERSION, "digest": digest, "files": stats}
    errors = []
    for i, path in enumerate(caches):
        try:
            _write_cache(path, entry, make_dir=i > 0)
            return digest
        except OSError as e:
            errors.append(f"{path.parent}: {e.strerror or e}")
    if not _warned_no_cache:
        _warned_no_cache = True
        logger.info("cannot cache the model fingerprint (%s): it is recomputed at every start", "; ".join(errors))
    return digest


def compat_hash(plan: KVPlan, model_fingerprint: str, dtype: str) -> str:
    """What two instances must share to exchange blocks: model, dtype, groups (kinds, windows, block size, layers,
    page sizes), specs (a recurrent state's shapes, dtypes and scan chunk), state pages and KV sharing. The layout
    is not part of it: descriptors pair pages across layouts."""
    desc = {
        "version": COMPAT_VERSION,
        "model": model_fingerprint,
        "dtype": dtype,
        "groups": [[g.kind, g.sliding_window, g.block_size, list(g.layers), list(g.pages)] for g in plan.groups],
        "specs": [None if s is None else s.describe() for s in plan.specs],
        "shared": sorted(plan.shared.items()),
    }
    if plan.state is not None:  # page size and slot offsets: where each layer's state sits in the page bytes
        desc["state"] = plan.state.to_dict() | {
            "slots": [[s.layer, s.conv_offset, s.ssm_offset] for s in plan.state.slots]
        }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()
