"""The kernel loader: a build lock left by a killed build (torch's loader would wait on it forever, silently)
is removed; a fresh one, a build in progress elsewhere, is left alone."""

import logging
import os
import time

import torch.utils.cpp_extension

from hybridkv import native


def test_a_killed_builds_lock_is_removed_before_loading(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    build = native._build_dir()
    build.mkdir(parents=True)
    lock = build / "lock"
    lock.touch()
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **kw: seen.append(lock.exists()) or "module")
    native._build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridkv.native"):
            assert native._build(tmp_path / "kernel.cpp") == "module"
    finally:
        native._build.cache_clear()
    assert seen == [False], "the loader must not see the dead build's lock"
    assert "did not finish" in caplog.text


def test_a_fresh_lock_is_left_to_its_build(tmp_path):
    (tmp_path / "lock").touch()
    assert not native.clear_stale_lock(tmp_path)
    assert (tmp_path / "lock").exists()
    assert not native.clear_stale_lock(tmp_path / "absent")


def test_a_failed_build_is_tried_again_after_a_while(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    results = iter([RuntimeError("raced"), "module"])

    def load(*a, **kw):
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    now = [1000.0]
    monkeypatch.setattr(native.time, "monotonic", lambda: now[0])
    source = tmp_path / "kernel.cpp"
    native._build.cache_clear()
    try:
        assert native.load_kernel(source) is None
        now[0] += native.RETRY_S / 2
        assert native.load_kernel(source) is None  # not yet: no rebuild on every call
        now[0] += native.RETRY_S
        assert native.load_kernel(source) == "module"
        assert native.load_kernel(source) == "module"
    finally:
        native._build.cache_clear()
        native._failed.clear()
