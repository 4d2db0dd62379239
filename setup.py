"""The install step that compiles the native kernels (`hybridkv/*/kernels/*.cpp`) into `hybridkv/build` with this
machine's g++ (`-march=native`): `pip install -e .` builds them beside the sources, `pip install .` / `pip wheel .`
into the wheel (a wheel is for the machine that built it). Everything else is in pyproject.toml.

The kernels are torch extensions, so the build environment holds `torch==2.13.0` (pyproject's `[build-system]`).
A kernel that does not build (no compiler, a compile error) never fails the install: `hybridkv.native` compiles it
at first use, saying so in the log, or runs the torch path. `pip install -v` shows a line per kernel."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _native_build():  # type: ignore[no-untyped-def]
    """hybridkv/native_build.py, loaded by its path: the package's own imports are not installed yet."""
    spec = importlib.util.spec_from_file_location("hybridkv_native_build", ROOT / "hybridkv" / "native_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """`build_ext` for the kernels: into the source tree for an editable install, else into the build folder."""

    def run(self) -> None:
        native_build = _native_build()
        into = native_build.INSTALL_DIR if self.inplace else Path(self.build_lib) / "hybridkv" / "build"
        jobs_env = os.environ.get("MAX_JOBS", "")
        if jobs_env and not jobs_env.isdigit():
            raise ValueError(f"MAX_JOBS is how many kernels compile at once: set a whole number, not {jobs_env!r}")
        jobs = int(jobs_env or 0) or None
        self._outputs: list[str] = []
        for line in native_build.install_kernels(into, jobs=jobs):
            print(f"hybridkv: {line}", file=sys.stderr, flush=True)
        if not self.inplace and into.is_dir():  # an editable install's kernels stay in the source tree
            (into / native_build.LOCK_NAME).unlink(missing_ok=True)  # the wheel carries modules and stamps only
            self._outputs = [str(path) for path in sorted(into.iterdir())]

    def get_outputs(self) -> list[str]:
        return getattr(self, "_outputs", [])

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BinaryDistribution(Distribution):
    """A wheel holding the compiled kernels is tagged for this platform and Python, not `py3-none-any`."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_ext": BuildKernels}, distclass=BinaryDistribution)
