"""Fixtures of the attack tests. Imports happen inside them: tests/pd/pd_util.py skips its importers when NIXL is
missing, and the tests here that need no NIXL must still run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def secure_mesh():
    """(prefill, decode, proxy) on loopback with a mesh secret; the prefill's leases live at most 2*3+5 s."""
    from hybridkv.connectors.mesh_auth import SECRET_ENV
    from tests.pd.attack_util import MODEL, SECRET
    from tests.pd.pd_util import fronted, server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET)
        p, d, x = fronted(server(MODEL, kv_transfer_timeout_s=5, wait=False), server(MODEL, wait=False))
        yield p, d, x
        for proc in (x, p, d):
            proc.stop()


@pytest.fixture(scope="module")
def secure_single():
    """prompt -> its greedy output from one instance, for the prompts the attack tests send."""
    from tests.pd.attack_util import ATTACKER, MODEL, VICTIM
    from tests.pd.pd_util import HELDOUT, single_instance

    prompts = [VICTIM, ATTACKER, *(it["prompt"] for it in HELDOUT[52:60])]
    return dict(zip(prompts, single_instance(MODEL, prompts)))
