"""Point 10 of issue 31: the lazily built kernels live in a predictable folder, so a module there is loaded only
where no other user can have planted or swapped it; otherwise one warning and the torch path (nothing compiles
there either)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from hybridkv import native, native_build
from tests.test_native import fresh_loader, needs_compiler, no_compile, tiny  # noqa: F401


@pytest.fixture
def planted(tmp_path, tiny, monkeypatch):  # noqa: F811
    """A current build of `tiny` sitting in the lazy folder (as another process, or another user, left it), and
    an install folder without it: load_kernel must decide on the lazy one alone, without compiling."""
    built = tmp_path / "built"
    native_build.install_kernels(built, [tiny])
    monkeypatch.setattr(native_build, "INSTALL_DIR", tmp_path / "empty")
    monkeypatch.setattr(native, "compile_kernel", no_compile)
    lazy = native._build_dir()
    lazy.mkdir(parents=True)
    for f in built.glob("hybridkv_tiny*"):
        shutil.copy(f, lazy / f.name)
    so = next(lazy.glob("hybridkv_tiny*.so"))
    lazy.chmod(0o700)
    so.chmod(0o700)
    return tiny, lazy, so


def load(source: Path, caplog) -> object | None:
    native._build.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hybridkv.native"):
        return native.load_kernel(source)


@needs_compiler
def test_a_module_only_this_user_can_write_loads(planted, caplog):
    source, lazy, _ = planted
    module = load(source, caplog)
    assert module is not None and Path(module.__file__).parent == lazy and not caplog.records


@needs_compiler
@pytest.mark.parametrize("where", ["folder writable by all", "module group-writable", "module is a link"])
def test_a_module_another_user_could_have_planted_is_not_loaded(planted, caplog, tmp_path, where):
    source, lazy, so = planted
    if where == "folder writable by all":
        lazy.chmod(0o777)
        expect = f"other users may write to {lazy} (mode 777, not sticky)"
    elif where == "module group-writable":
        so.chmod(0o770)
        expect = f"other users may write to {so} (mode 770"
    else:
        real = tmp_path / so.name
        shutil.move(so, real)
        os.symlink(real, so)
        expect = "not a regular file"
    assert load(source, caplog) is None  # nothing loaded, nothing compiled (compile_kernel raises)
    assert expect in caplog.text and "using the torch path" in caplog.text


@needs_compiler
def test_a_folder_above_it_writable_by_others_stops_the_lazy_build(planted, caplog):
    source, lazy, _ = planted
    lazy.parent.chmod(0o777)
    try:
        assert load(source, caplog) is None
        assert f"other users may write to {lazy.parent}" in caplog.text
    finally:
        lazy.parent.chmod(0o700)


def test_a_new_lazy_folder_is_created_private(tmp_path):
    build = tmp_path / "cache" / "kernels" / "x"
    assert native._private_build_dir(build)
    assert all((d.stat().st_mode & 0o777) == 0o700 for d in (build, build.parent, build.parent.parent))
