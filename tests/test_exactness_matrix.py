"""The exactness tests again, in fresh processes, on the other instruction-set paths this CPU can be forced onto
and with the native kernels off: every mode (batch, chunking, prefix hits, preemption, layouts, PD, offload) must
still give the single run's bits there. The default run of the suite covers this CPU's own paths (AVX-512 where
it has it).

    avx2   torch's own kernels (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS) and oneDNN
           (ONEDNN_MAX_CPU_ISA) capped at AVX2: the vector widths and BLAS kernels of a CPU without AVX-512
           (skipped on such a CPU: there the cap changes nothing and the default run is this leg);
    torch  HYBRIDKV_KERNELS=torch: no native kernel (decodes attend in torch, one request per call).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
SUITES = [  # every bit-for-bit test: engine modes, PD through the proxy (servers inherit the environment), offload
    "tests/models/test_split_sum.py",
    "tests/engine/test_exact_hybrid.py",
    "tests/engine/test_exact_attention.py",
    "tests/engine/test_int8_state.py",
    "tests/pd/test_pd_hybrid.py",
    "tests/pd/test_pd_exact_attention.py",
    "tests/offload/test_offload_hybrid.py",
    "tests/offload/test_offload_exact_attention.py",
]
SKIP = "not lm_eval"  # the accuracy sweep through lm-eval: the same bits as its PD test above, ten times the time
NARROWER = {  # per leg, tests left out beyond SKIP (CI's 30 minutes): the torch leg runs PD for one layout pair per
    # model, the mixed one, and no int8 states through PD. Which kernels compute does not change which bytes PD
    # moves, and the in-process suites of the leg still run every layout, prefix hit and int8 state under torch.
    "torch": "not layouts1 and not int8_states_through_the_proxy",
}
MATRIX = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "torch": {"HYBRIDKV_KERNELS": "torch"},
}
SHOWN = {  # the line of the run's header that proves the setting took effect
    "avx2": "cpu capability AVX2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2",
    "torch": "HYBRIDKV_KERNELS=torch",
}


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_every_mode_gives_the_single_runs_bits_on_this_path(name):
    if name == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU's own path is AVX2 (no AVX-512): the default run of the suite has just covered it")
    env = {**os.environ, **MATRIX[name]}
    select = SKIP if name not in NARROWER else f"{SKIP} and {NARROWER[name]}"
    cmd = [sys.executable, "-m", "pytest", *SUITES, "-k", select, "-x", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = run.stdout + run.stderr
    assert SHOWN[name] in out, out[:2000]
    assert run.returncode == 0, out[-4000:]
    assert " passed" in out and "failed" not in out, out[-2000:]
