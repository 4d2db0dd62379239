"""The kernel loader: the install's build is used as it is; a missing or stale one is compiled at first use with
a progress line; a killed build does not delay the next process (its flock dies with it, and torch's lock file
stays in its private folder); a build in progress is waited for, with a line; no compiler costs one line and the
torch path."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridkv import native, native_build

# A Python module that compiles in a second or two (the real kernels take a minute each); its name is the one
# torch's loader gives it, which gets a `_v1` suffix when one process builds two versions of it.
TINY = """#include <Python.h>
#define HKV_STR2(x) #x
#define HKV_STR(x) HKV_STR2(x)
#define HKV_CAT2(a, b) a##b
#define HKV_CAT(a, b) HKV_CAT2(a, b)
static PyModuleDef def = {PyModuleDef_HEAD_INIT, HKV_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC HKV_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""
LOAD = """import sys, time
from pathlib import Path
from hybridkv import native
start = time.monotonic()
module = native.load_kernel(Path(sys.argv[1]))
print(module and module.__name__, round(time.monotonic() - start, 1), flush=True)
"""
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def fresh_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    monkeypatch.setattr(native, "_said", set())
    native._build.cache_clear()
    native._failed.clear()
    yield
    native._build.cache_clear()
    native._failed.clear()


@pytest.fixture
def tiny(tmp_path) -> Path:
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY)
    return source


def no_compile(*args, **kwargs):
    raise AssertionError("compiled, where a built module was current")


def kill_session(session: int) -> None:
    """SIGKILL every process of `session` (a Popen started with start_new_session: its pid is the session's id)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == session:
                os.kill(int(stat.parent.name), signal.SIGKILL)


@needs_compiler
def test_the_installed_kernel_loads_without_compiling(tmp_path, tiny, monkeypatch, caplog):
    installed = tmp_path / "installed"
    assert native_build.install_kernels(installed, [tiny])[0].startswith("native kernel tiny: compiled in")
    assert native_build.install_kernels(installed, [tiny])[0].startswith("native kernel tiny: up to date")
    monkeypatch.setattr(native_build, "INSTALL_DIR", installed)
    monkeypatch.setattr(native, "compile_kernel", no_compile)
    with caplog.at_level(logging.INFO, logger="hybridkv.native"):
        module = native.load_kernel(tiny)
    assert Path(module.__file__).parent == installed
    assert not caplog.records


@needs_compiler
def test_a_stale_install_compiles_at_first_use_with_progress_lines(tmp_path, tiny, monkeypatch, caplog):
    installed = tmp_path / "installed"
    native_build.install_kernels(installed, [tiny])
    monkeypatch.setattr(native_build, "INSTALL_DIR", installed)
    tiny.write_text(TINY + "// edited after the install\n")
    monkeypatch.setattr(native, "PROGRESS_S", 0.05)
    with caplog.at_level(logging.WARNING, logger="hybridkv.native"):
        module = native.load_kernel(tiny)
    assert Path(module.__file__).parent == native._build_dir()
    assert "compiling native kernel tiny (its sources changed since it was built; once per machine, ~" in caplog.text
    assert "still compiling native kernel tiny" in caplog.text
    assert "compiled native kernel tiny in" in caplog.text

    native._build.cache_clear()  # the next process: the lazy build is current, nothing compiles
    monkeypatch.setattr(native, "compile_kernel", no_compile)
    assert Path(native.load_kernel(tiny).__file__).parent == native._build_dir()


@needs_compiler
def test_a_killed_build_does_not_delay_the_next_start(tmp_path, tiny):
    """A build SIGKILLed while compiling leaves torch's lock file behind (torch's loader waits on one with no end);
    the next process neither waits on it nor on the dead build's flock, and builds at once."""
    marker = tmp_path / "compiling"
    slow = tmp_path / "bin" / "slow-g++"  # a compiler that hangs on the compile step (links and probes go through)
    slow.parent.mkdir()
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) touch {marker}; exec sleep 300;; esac\nexec g++ "$@"\n')
    slow.chmod(0o755)
    env = {**os.environ, "CXX": str(slow)}
    build = native._build_dir()
    first = subprocess.Popen([sys.executable, "-c", LOAD, str(tiny)], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first build never reached its compile step"
            time.sleep(0.1)
        with open(build / native_build.LOCK_NAME) as held, pytest.raises(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first build holds the folder
    finally:
        kill_session(first.pid)  # the build, its ninja and its compiler (which ninja puts in a group of its own)
        first.communicate()
    (dead,) = build.glob(f"{native_build.BUILDING}*")
    assert (dead / "lock").exists(), "the killed build left torch's lock file (in its private folder)"

    start = time.monotonic()
    second = subprocess.run([sys.executable, "-c", LOAD, str(tiny)], env=dict(os.environ), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert second.returncode == 0, second.stderr
    name, seconds = second.stdout.split()
    assert name == "hybridkv_tiny", second.stderr
    assert "waiting for process" not in second.stderr
    assert not dead.exists(), "the next build removes a killed build's folder"
    assert float(seconds) < 120 and time.monotonic() - start < 180  # a compile of a second or two, no wait


def test_a_build_in_progress_is_waited_for_with_a_line(tmp_path, monkeypatch, caplog):
    held, release = threading.Event(), threading.Event()

    def builder() -> None:
        with native_build.build_lock(tmp_path):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=builder)
    thread.start()
    held.wait(10)
    threading.Timer(0.5, release.set).start()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridkv.native"), native_build.build_lock(tmp_path):
        waited = time.monotonic() - start
    thread.join()
    assert waited >= 0.4
    assert f"waiting for process {os.getpid()}, which is compiling native kernels in {tmp_path}" in caplog.text


def test_without_a_compiler_one_line_and_the_torch_path(tmp_path, tiny, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setattr(native_build, "INSTALL_DIR", tmp_path / "installed")
    other = tiny.with_name("other.cpp")
    other.write_text(TINY)
    with caplog.at_level(logging.INFO, logger="hybridkv.native"):
        assert native.load_kernel(tiny) is None
        assert native.load_kernel(other) is None
    assert len(caplog.records) == 1, caplog.text
    assert "no-such-g++" in caplog.text and "using the torch path" in caplog.text
    assert native_build.install_kernels(tmp_path / "installed", [tiny])[0].startswith("native kernels not built: no")


def test_the_torch_mode_loads_nothing(tiny, monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "torch")
    monkeypatch.setattr(native, "compile_kernel", no_compile)
    assert native.load_kernel(tiny) is None
    monkeypatch.setenv(native.KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="HYBRIDKV_KERNELS must be one of native, torch"):
        native.load_kernel(tiny)


@needs_compiler
def test_a_failed_build_is_tried_again_after_a_while(tiny, monkeypatch):
    calls = []

    def compile_kernel(source: Path, directory: Path) -> float:
        calls.append(source)
        if len(calls) == 1:
            raise RuntimeError("raced")
        return native_build.compile_kernel(source, directory)

    monkeypatch.setattr(native, "compile_kernel", compile_kernel)
    now = [1000.0]
    monkeypatch.setattr(native.time, "monotonic", lambda: now[0])
    assert native.load_kernel(tiny) is None
    now[0] += native.RETRY_S / 2
    assert native.load_kernel(tiny) is None  # not yet: no rebuild on every call
    now[0] += native.RETRY_S
    assert native.load_kernel(tiny).__name__.startswith("hybridkv_tiny")  # `_vN`: torch numbers rebuilds
    assert native.load_kernel(tiny).__name__.startswith("hybridkv_tiny")  # `_vN`: torch numbers rebuilds
    assert len(calls) == 2


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernels are x86 (AVX-512 where the CPU has it)")
def test_the_install_built_every_kernel_for_this_machine():
    """`pip install -e .` compiled every kernel here, so a first start compiles nothing. A kernel edited since
    is compiled at first use (with a progress line) until the next install."""
    for source in native_build.kernel_sources():
        why = native_build.stale_reason(native_build.read_stamp(native_build.INSTALL_DIR, source),
                                        native_build.build_key(source))  # fmt: skip
        assert why in (None, "its sources changed since it was built"), (
            f"native kernel {source.stem} in {native_build.INSTALL_DIR}: {why}; run `pip install -e .` again"
        )


def test_a_stale_stamp_says_why(tiny):
    key = native_build.build_key(tiny)
    assert native_build.stale_reason({"key": dict(key)}, key) is None
    assert native_build.stale_reason(None, key) == "not built"
    assert native_build.stale_reason({"key": {**key, "cpu": "0" * 12}}, key) == "built on another CPU"
    old = native_build.stale_reason({"key": {**key, "torch": "2.12.0"}}, key)
    assert old == f"built for torch 2.12.0, this is {key['torch']}"
