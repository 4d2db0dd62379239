"""scripts/device_check.sh, the GPU lane's one command, in its dry run on CPU: every step is listed, and what the
steps name (test files, matrix suites, benchmark flags) exists; a step naming a missing file fails the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
STEPS = ("== wheels", "== machine", "== tests", "== matrix", "== bench", "need nixl-cu12")


def dry_run(root: Path) -> subprocess.CompletedProcess:
    script = root / "scripts" / "device_check.sh"
    return subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=300)


def test_the_dry_run_lists_every_step_and_finds_what_they_name():
    run = dry_run(ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for step in STEPS:
        assert step in run.stdout, run.stdout
    assert "HYBRIDKV_DEVICE" in (ROOT / "scripts" / "device_check.sh").read_text()


def test_a_step_naming_a_missing_file_fails_the_dry_run(tmp_path):
    for name in ("tests", "benchmarks", "hybridkv"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "scripts").mkdir()
    wheels = ROOT / "scripts" / "device_wheels.sh"
    (tmp_path / "scripts" / "device_wheels.sh").write_text(wheels.read_text())
    text = (ROOT / "scripts" / "device_check.sh").read_text()
    broken = text.replace("    tests/engine/test_parity.py\n", "    tests/engine/test_renamed_away.py\n")
    assert broken != text
    (tmp_path / "scripts" / "device_check.sh").write_text(broken)
    run = dry_run(tmp_path)
    assert run.returncode == 1 and "test_renamed_away.py does not exist" in run.stderr
