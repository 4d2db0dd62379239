import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def ruff() -> str:
    """ruff's path. Missing, the test skips locally but fails in CI (CI set, as .ci/run's caller sets CI=true):
    there the style check must run, not vanish from the report as a skip."""
    path = shutil.which("ruff")
    if path is None:
        reason = "ruff is not installed (pip install -e '.[test]' installs it)"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{reason}; CI={os.environ['CI']!r} demands the style check")
        pytest.skip(reason)
    return path


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff_clean(args):
    r = subprocess.run([ruff(), *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
