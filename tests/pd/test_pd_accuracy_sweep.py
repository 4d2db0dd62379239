"""`hybridkv bench pd-accuracy` end to end on a small slice, as CI runs it: the embedded model, packed and mixed
layouts, 1P1D and 2P1D, through our proxy and vllm-router (when installed); real processes on loopback."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

from hybridkv.launch import hybridkv_command

pytest.importorskip("lm_eval")
try:
    from hybridkv.connectors.pd.transport import _nixl

    _nixl()
except ValueError:
    pytest.skip("NIXL is not installed (pip install nixl-cu12)", allow_module_level=True)


def test_a_small_slice_equals_the_single_instance_in_every_cell():
    routers = ["proxy", "vllm-router"] if shutil.which("vllm-router") else ["proxy"]
    args = ["bench", "pd-accuracy", "--models", "embedded", "--layouts", "packed,mixed", "--topologies", "1P1D,2P1D"]
    args += ["--routers", ",".join(routers), "--limit", "8", "--num-prompts", "8"]
    start = time.monotonic()
    r = subprocess.run([*hybridkv_command(), *args], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    cells = 2 * 2 * len(routers)
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ embedded")]
    assert len(rows) == cells, r.stdout
    for row in rows:  # score equals single, 8/8 greedy texts and logprobs, KV read, ok
        fields = [f.strip() for f in row.strip("│").split("│")]
        score, single, greedy, logprobs, reads, verdict = fields[4:]
        assert score == single and greedy == logprobs == "8/8" and verdict == "ok", row
        assert all(int(n) >= 8 for n in re.findall(r"\d+", reads)), row  # at least one read per greedy prompt
    assert f"{cells}/{cells} cells pass" in r.stdout
    print(f"{cells} cells in {time.monotonic() - start:.0f} s")
