"""Compiling the native kernels (`hybridkv/*/kernels/*.cpp`), shared by the install (`setup.py`, which runs this file
by its path: it imports nothing of hybridkv, and torch only inside functions) and by a lazy build at first use
(`hybridkv.native`). Both compile with torch's C++ extension loader, the same flags, and record what a build was
made for in a stamp beside the module (`hybridkv_<stem>.json`): torch, Python, this CPU's instruction-set flags
(the kernels are compiled with `-march=native`), the flags and a digest of the sources and every kernel header.
A module is used only where its stamp matches this machine and these sources.

`build_lock` is an `flock` on `<dir>/build.lock`: the OS drops it when its holder exits however it exits, so a
killed build never blocks the next one. Each build runs in a private folder, so torch's own lock file (which a
killed build leaves behind, and which torch's loader waits on with no end) never sits where another build looks."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
INSTALL_DIR = PACKAGE / "build"  # where `pip install` puts the kernels (git-ignored: `build/`)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LOCK_NAME = "build.lock"
BUILDING = ".building-"  # prefix of a build's private folder
WAIT_LOG_S = 30.0  # a wait for another process's build says so at its start and then this often

log = logging.getLogger("hybridkv.native")


def kernel_sources() -> list[Path]:
    """Every kernel of the package, in a stable order."""
    return sorted(PACKAGE.glob("*/kernels/*.cpp"))


def module_name(source: Path) -> str:
    return f"hybridkv_{source.stem}"


def cpu_flags() -> str:
    """A digest of this CPU's `flags` line (/proc/cpuinfo); empty input where there is none."""
    flags = ""
    with contextlib.suppress(OSError, StopIteration):
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def build_key(source: Path) -> dict[str, str]:
    """What a build of `source` made now would be made for; a stamp holding the same key is a module to use."""
    import torch

    digest = hashlib.sha256(source.read_bytes())
    for header in sorted({*PACKAGE.glob("*/kernels/*.h"), *source.parent.glob("*.h")}):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return {
        "torch": torch.__version__,
        "python": sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
        "cpu": cpu_flags(),
        "flags": " ".join(CFLAGS + LDFLAGS),
        "sources": digest.hexdigest()[:16],
    }


def read_stamp(directory: Path, source: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        stamp = json.loads((directory / f"{module_name(source)}.json").read_text())
        if isinstance(stamp, dict) and isinstance(stamp.get("key"), dict):
            return stamp
    return None


def stale_reason(stamp: dict | None, key: dict[str, str]) -> str | None:
    """None where `stamp` was made for `key`, else why not, in words."""
    if stamp is None:
        return "not built"
    old = stamp["key"]
    if old.get("sources") != key["sources"]:
        return "its sources changed since it was built"
    if old.get("cpu") != key["cpu"]:
        return "built on another CPU"
    for field in ("torch", "python", "flags"):
        if old.get(field) != key[field]:
            return f"built for {field} {old.get(field)}, this is {key[field]}"
    return None


def import_module(directory: Path, stamp: dict) -> object:
    """The module a stamp in `directory` describes (torch must be imported first: it links to torch's libraries)."""
    import importlib.util

    import torch  # noqa: F401

    path = directory / stamp["file"]
    spec = importlib.util.spec_from_file_location(stamp["module"], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_kernel(source: Path, directory: Path) -> float:
    """Compile `source` into `directory` with torch's loader (g++ and ninja) and stamp it; the seconds taken. It is
    built in a private folder (`.building-*`) and moved in whole: a build killed midway leaves only that folder,
    torch's lock file inside it blocks no one, and the next build under `build_lock` removes it."""
    from torch.utils.cpp_extension import load

    key = build_key(source)
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{BUILDING}{source.stem}-", dir=directory))
    try:
        start = time.monotonic()
        module = load(module_name(source), [str(source)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                      build_directory=str(work))  # fmt: skip
        seconds = time.monotonic() - start
        built = Path(module.__file__)
        os.replace(built, directory / built.name)
        stamp = {"module": module.__name__, "file": built.name, "key": key, "seconds": round(seconds, 1)}
        _write_atomic(directory / f"{module_name(source)}.json", json.dumps(stamp, indent=1).encode())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return seconds


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory` for a build: an exclusive `flock` on `directory/build.lock` (never deleted), which the OS
    releases when the holder exits, killed or not. A wait for a live holder is logged, with its pid; the private
    folders of builds that were killed are removed once it is held."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_NAME, "a+") as lock:
        start = time.monotonic()
        logged = None
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if logged is None or waited - logged >= WAIT_LOG_S:
                    lock.seek(0)
                    holder = lock.read().strip() or "?"
                    log.warning("waiting for process %s, which is compiling native kernels in %s (%.0f s so far)",
                                holder, directory, waited)  # fmt: skip
                    logged = waited
                time.sleep(0.2)
        try:
            lock.truncate(0)
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            for dead in directory.glob(f"{BUILDING}*"):
                log.info("removing %s, left by a kernel build that was killed", dead)
                shutil.rmtree(dead, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def install_kernels(target: Path, sources: Sequence[Path] | None = None, jobs: int | None = None) -> list[str]:
    """Compile every kernel into `target` (the install step of `setup.py`), in parallel; kernels whose stamp in
    `target` already matches are kept. Never raises: one line per kernel says what happened, and a kernel that
    did not build is compiled at first use or replaced by the torch path."""
    sources = kernel_sources() if sources is None else list(sources)
    if os.environ.get("HYBRIDKV_KERNELS") == "torch":
        return ["native kernels not built: HYBRIDKV_KERNELS=torch"]
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return [f"native kernels not built: no C++ compiler ({compiler!r}) on PATH; the torch path runs instead"]
    workers = max(1, min(len(sources), jobs or os.cpu_count() or 1))
    with build_lock(target), ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda source: _install_one(source, target), sources))


def _install_one(source: Path, target: Path) -> str:
    name = source.stem
    try:
        if stale_reason(read_stamp(target, source), build_key(source)) is None:
            return f"native kernel {name}: up to date in {target}"
        return f"native kernel {name}: compiled in {compile_kernel(source, target):.0f} s into {target}"
    except Exception as e:  # a compile error, no ninja: the install goes on, the kernel is built or skipped later
        why = (str(e).strip().splitlines() or [""])[0][:200]
        return f"native kernel {name}: not built ({type(e).__name__}: {why}); compiled at first use instead"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a process loading it meanwhile sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
