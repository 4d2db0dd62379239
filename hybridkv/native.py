"""One switch for the native fast paths: `HYBRIDKV_KERNELS=native` (the default) lets models pack their linear
weights for oneDNN (`models/linear.py`) and use fused elementwise kernels (`models/kernels`), and the runner use
its compiled attention kernels (`runner/kernels`); `HYBRIDKV_KERNELS=torch` runs plain torch everywhere (the
reference the fast paths are tested against).

`load_kernel` compiles a kernel on first use with torch's C++ extension loader (g++ and ninja). The build lands in
`$HYBRIDKV_CACHE_DIR/kernels/<torch>-<cpu>-<checkout>` (default `~/.cache/hybridkv`), keyed by the torch version,
this CPU's instruction-set flags (it is compiled with `-march=native`) and the checkout; a machine that cannot
build one logs why, once, and its caller falls back to plain torch."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

KERNELS_ENV = "HYBRIDKV_KERNELS"
MODES = ("native", "torch")
# torch's loader holds `<build>/lock` while it compiles (about a minute) and waits, with no end and no message,
# while another process holds it; a lock this old was left by a build that was killed.
STALE_LOCK_S = 600
RETRY_S = 60  # a failed build is tried again after this long (a sibling's build may have raced it), not sooner

log = logging.getLogger(__name__)


def native_enabled() -> bool:
    mode = os.environ.get(KERNELS_ENV, "native")
    if mode not in MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "native"


def _build_dir() -> Path:
    import torch

    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    cpu = hashlib.sha256(flags.encode()).hexdigest()[:12]
    root = Path(os.environ.get("HYBRIDKV_CACHE_DIR", Path.home() / ".cache" / "hybridkv"))
    # One folder per checkout: torch rebuilds whenever a source's path changes, so two checkouts sharing a folder
    # (a CI clone beside a working tree) would rebuild each other's kernels on every start.
    checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return root / "kernels" / f"torch{torch.__version__}-{cpu}-{checkout}"


def _headers_digest() -> str:
    """A digest of every kernel header (`hybridkv/*/kernels/*.h`): the loader rebuilds when a kernel's source or
    flags change, and headers reach it here."""
    digest = hashlib.sha256()
    for header in sorted(Path(__file__).parent.glob("*/kernels/*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def load_kernel(source: Path) -> object | None:
    """The compiled module of the C++ file `source` (named `hybridkv_<stem>`), or None: the kernels are off
    (`HYBRIDKV_KERNELS=torch`) or the build failed (logged; tried again after RETRY_S, so one failure, such as a
    race with another process building the same folder, does not cost the process its kernels for good)."""
    if not native_enabled():
        return None
    module = _build(source)
    if module is None and time.monotonic() - _failed.setdefault(source, time.monotonic()) > RETRY_S:
        del _failed[source]
        _build.cache_clear()
        module = _build(source)
    return module


_failed: dict[Path, float] = {}  # source -> when its build first failed (monotonic seconds)


@functools.cache
def _build(source: Path) -> object | None:
    from torch.utils.cpp_extension import load

    build = _build_dir()
    try:
        build.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build)
        log.info("loading native kernel %s (compiled once per machine into %s, about a minute)", source.stem, build)
        return load(
            f"hybridkv_{source.stem}",
            [str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DHYBRIDKV_SOURCES={_headers_digest()}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
        )
    except Exception as e:  # no compiler, no ninja, a read-only home: the torch path still works
        why = str(e).splitlines()[0][:200] if str(e) else ""
        log.warning("native kernel %s unavailable, using the torch path (%s: %s); set %s=torch to skip the build",
                    source.stem, type(e).__name__, why, KERNELS_ENV)  # fmt: skip
        return None


def clear_stale_lock(build: Path) -> bool:
    """Remove the build lock of a killed build (older than STALE_LOCK_S); whether one was removed."""
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
        if age <= STALE_LOCK_S:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    log.warning("removed %s, left %.0f s ago by a kernel build that did not finish", lock, age)
    return True
