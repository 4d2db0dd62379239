import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff_clean(args):
    r = subprocess.run(["ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
