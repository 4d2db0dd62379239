"""One switch for the native fast paths: `HYBRIDKV_KERNELS=native` (the default) lets models pack their linear
weights for oneDNN (`models/linear.py`) and use fused elementwise kernels (`models/kernels`), and the runner use
its compiled attention kernels (`runner/kernels`); `HYBRIDKV_KERNELS=torch` runs plain torch everywhere (the
reference the fast paths are tested against).

The kernels are compiled at install (`pip install -e .` runs `setup.py`, which puts them in `hybridkv/build`; see
`native_build`). `load_kernel` uses that build when its stamp matches this machine and these sources; otherwise
(no compiler at install, a checkout copied to another CPU, a kernel edited since) it compiles the kernel once into
`$HYBRIDKV_CACHE_DIR/kernels/<torch>-<cpu>-<checkout>` (default `~/.cache/hybridkv`), saying so in the log with a
progress line; a machine that cannot build one logs why and its caller falls back to plain torch.

The lazy folder's path is predictable, so what lies there is loaded only where another user cannot have planted or
swapped it (`ownership.py`): the folder is created 0700, it and each module must belong to this user and be
writable by no one else, and every folder above it must be this user's or root's and not writable by others
unless sticky. Otherwise nothing is loaded or compiled there: one warning says why and the torch path runs."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hybridkv import native_build
from hybridkv.native_build import build_key, build_lock, compile_kernel, import_module, read_stamp, stale_reason
from hybridkv.ownership import unsafe_ancestor, unsafe_own

KERNELS_ENV = "HYBRIDKV_KERNELS"
MODES = ("native", "torch")
RETRY_S = 60  # a failed build is tried again after this long (a sibling's build may have raced it), not sooner
PROGRESS_S = 30.0  # a lazy compile says it is still going this often
DEFAULT_ESTIMATE_S = 60  # a kernel's compile time where no earlier build of it recorded one (2-core machine: 40-130)

log = logging.getLogger(__name__)


def native_enabled() -> bool:
    mode = os.environ.get(KERNELS_ENV, "native")
    if mode not in MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "native"


def tiles_allowed() -> bool:
    """Whether kernels may use AMX tiles: yes unless oneDNN is capped below them (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`,
    say), so that one cap runs the whole process as on a CPU without AMX: oneDNN's layouts and arithmetic, the
    few-row linears (packed_rows instead of packed_tiles) and prefill attention's vector path."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper()
    return cap in ("", "ALL", "DEFAULT") or "AMX" in cap


def _build_dir() -> Path:
    """The lazy builds' folder: one per torch version, CPU and checkout (a home shared by machines, or by two
    checkouts at different sources, keeps a build of each instead of replacing one with the other at every start)."""
    import torch

    root = Path(os.environ.get("HYBRIDKV_CACHE_DIR", Path.home() / ".cache" / "hybridkv"))
    checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return root / "kernels" / f"torch{torch.__version__}-{native_build.cpu_flags()}-{checkout}"


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
_said: set[str] = set()  # process-wide warnings already logged


@functools.cache
def _build(source: Path) -> object | None:
    """The installed build of `source` if it is current, else the lazy one (compiled now if need be), else None."""
    try:
        key = build_key(source)
        installed = read_stamp(native_build.INSTALL_DIR, source)
        why = stale_reason(installed, key)
        if why is None and (module := _import(native_build.INSTALL_DIR, installed)) is not None:
            return module
        why = "not built at install" if installed is None else why or "the installed module does not load"
        if not _private_build_dir(build := _build_dir()):
            return None
        if (module := _import_current(build, source, key)) is not None:
            return module
        if not _tools_present():
            return None
        with build_lock(build):
            if (module := _import_current(build, source, key)) is not None:  # built while this process waited
                return module
            cached = read_stamp(build, source)
            estimate = next((s["seconds"] for s in (installed, cached) if s and s.get("seconds")), DEFAULT_ESTIMATE_S)
            log.warning("compiling native kernel %s (%s; once per machine, ~%.0f s)…", source.stem, why, estimate)
            with _progress(source.stem):
                seconds = compile_kernel(source, build)
        log.warning("compiled native kernel %s in %.0f s into %s (`pip install -e .` compiles the kernels at install)",
                    source.stem, seconds, build)  # fmt: skip
        if (stamp := read_stamp(build, source)) is None:
            raise RuntimeError(f"the build left no stamp in {build}")
        if (problem := _unsafe_module(build, stamp)) is not None:
            raise RuntimeError(f"the module it built cannot be trusted: {problem}")
        return import_module(build, stamp)
    except Exception as e:  # a compile error, a read-only home: the torch path still works
        why = str(e).splitlines()[0][:200] if str(e) else ""
        log.warning("native kernel %s unavailable, using the torch path (%s: %s); set %s=torch to skip the build",
                    source.stem, type(e).__name__, why, KERNELS_ENV)  # fmt: skip
        return None


def _import_current(directory: Path, source: Path, key: dict[str, str]) -> object | None:
    """The lazy build of `source` in `directory` if it is current and ours alone (else None, logged once)."""
    stamp = read_stamp(directory, source)
    if stale_reason(stamp, key) is not None:
        return None
    if (problem := _unsafe_module(directory, stamp)) is not None:
        _warn_once(f"untrusted:{directory / str(stamp.get('file'))}", "not loading native kernel %s: %s; using the "
                   "torch path (remove it, or set %s=torch)", source.stem, problem, KERNELS_ENV)  # fmt: skip
        return None
    return _import(directory, stamp)


def _private_build_dir(build: Path) -> bool:
    """Create the lazy folder (each missing level 0700) and check that only this user can put modules in it.
    False (one warning) where another user could have planted or could swap what it holds."""
    try:
        for d in reversed([build, *build.parents]):
            if not d.exists():
                d.mkdir(mode=0o700)
        bad = unsafe_ancestor(build) or unsafe_own(build, os.lstat(build))
    except OSError as e:
        _warn_once(f"dir:{build}", "native kernels: cannot use %s (%s); using the torch path", build, e)
        return False
    if bad is not None:
        _warn_once(f"dir:{build}", "native kernels: not loading or building anything in %s: %s, so another user "
                   "could plant a module there; using the torch path (fix the permissions, set HYBRIDKV_CACHE_DIR to "
                   "a private folder, or set %s=torch)", build, bad.describe(), KERNELS_ENV)  # fmt: skip
        return False
    return True


def _unsafe_module(directory: Path, stamp: dict) -> str | None:
    """Why the module a stamp names cannot be trusted (not a plain file name, a link, not a regular file, not ours
    alone), else None. The stamp itself is trusted as far as its folder is (`_private_build_dir`)."""
    name = stamp.get("file")
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        return f"its stamp names {name!r}, not a file in {directory}"
    path = directory / name
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a link or other)"
    bad = unsafe_own(path, st)
    return None if bad is None else bad.describe()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message, *args)


def _import(directory: Path, stamp: dict | None) -> object | None:
    """The module `stamp` describes, or None (logged) where it does not load."""
    if stamp is None:
        return None
    try:
        return import_module(directory, stamp)
    except (ImportError, OSError) as e:
        log.warning("native kernel %s in %s does not load (%s); building it again", stamp["module"], directory,
                    str(e)[:200])  # fmt: skip
        return None


def _tools_present() -> bool:
    """Whether a lazy build can run: a C++ compiler and ninja. Where not, one warning for the whole process."""
    bin_dir = str(Path(sys.executable).parent)  # the environment's ninja, when its bin folder is not on PATH
    if shutil.which("ninja") is None and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing and "tools" not in _said:
        _said.add("tools")
        log.warning("native kernels unavailable, using the torch path: %s not found and the kernels were not built "
                    "at install (install g++ and run `pip install -e .` again, or set %s=torch to silence this)",
                    " and ".join(repr(tool) for tool in missing), KERNELS_ENV)  # fmt: skip
    return not missing


@contextlib.contextmanager
def _progress(name: str) -> Iterator[None]:
    """Log every PROGRESS_S that the compile of kernel `name` is still going."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(PROGRESS_S):
            log.warning("still compiling native kernel %s (%.0f s)…", name, time.monotonic() - start)

    thread = threading.Thread(target=tick, name=f"compile-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
