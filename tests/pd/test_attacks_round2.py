"""Issue 31, attacks 6 and 9, with real processes on loopback and no mesh secret (where params can be forged):
forged params naming closed ports cannot use up the decoder's peer workers (a new, real prefill instance stays
reachable through the fast path, /health answers within 100 ms), and one params set sent many times is read once.
Every instance ends with no block and no lease held."""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.pd.attack_util import ATTACKER, MODEL, PUBLIC, resign, stats, text
from tests.pd.pd_util import HELDOUT, assert_clean, complete, prefill_only, server
from tests.procs import free_port, together
from tests.serve.siege import HealthProbe

HEALTH_S = 0.1  # the longest /health may take during an attack


@pytest.fixture(scope="module")
def open_mesh():
    """(prefill, decode) on loopback without a mesh secret: anyone may forge params for this decoder."""
    from hybridkv.connectors.mesh_auth import SECRET_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SECRET_ENV, raising=False)
        p, d = together(server(MODEL, wait=False), server(MODEL, wait=False))
        yield p, d
        for proc in (p, d):
            proc.stop()


def reads(d) -> float:
    return stats(d)["kv_transfer_reads_total"]


def test_one_params_set_sent_eight_times_is_read_once(open_mesh):
    p, d = open_mesh
    prompt = HELDOUT[62]["prompt"]
    expected = text(complete(p.url, prompt))
    params = prefill_only(p, prompt)
    before = stats(d)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: complete(d.url, prompt, kv_transfer_params=params), range(8)))
    assert [text(o) for o in outs] == [expected] * 8  # the copies recompute: same answer
    assert text(complete(d.url, prompt, kv_transfer_params=params)) == expected  # a use after the read is done
    after = stats(d)
    assert after["kv_transfer_reads_total"] - before["kv_transfer_reads_total"] == 1  # one read, not one per copy
    assert after["kv_transfer_failures_total"] == before["kv_transfer_failures_total"]  # the copies contacted no one
    assert after["kv_transfer_params_refused_total"] - before["kv_transfer_params_refused_total"] == 8
    assert_clean(p, d)


def forged(template: dict) -> dict:
    """Params for `template`'s prompt, naming a closed local port and an engine nobody runs, signed with the
    public key (what anyone can do without a mesh secret)."""
    engine = "forged-" + secrets.token_hex(4)
    return resign(template, PUBLIC, engine_id=engine, port=free_port(), lease_id=secrets.token_hex(16))


def under_load(d, send, threads: int, count: int, during=None) -> tuple[list[float], list[dict], object]:
    """`threads` clients calling `send()` until `count` answers came back, then `during()` (while they go on),
    then stop; /health is timed every ~10 ms throughout, from another process (the clients' GIL is not measured).
    (/health times, answers, what `during` returned)."""
    stop, answers = threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            answers.append(send())

    with HealthProbe(d.url) as probe, ThreadPoolExecutor(threads) as pool:
        running = [pool.submit(client) for _ in range(threads)]
        deadline = time.monotonic() + 60
        while len(answers) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(answers) >= count, len(answers)
        result = during() if during else None
        stop.set()
        for f in running:
            f.result()
    return probe.latencies, answers, result


def test_forged_peers_cannot_use_up_the_decoders_peer_slots(open_mesh):
    p, d = open_mesh
    fresh = server(MODEL)  # a prefill instance this decoder has never contacted: it holds no reserved slot
    try:
        template, legit = prefill_only(p, ATTACKER), HELDOUT[63]["prompt"]
        expected = text(complete(fresh.url, legit))
        # The same load without params: what /health costs on this machine when 4 clients keep the engine busy.
        baseline, _, _ = under_load(d, lambda: complete(d.url, ATTACKER, max_tokens=1), 4, 96)

        def legit_request() -> tuple[dict, float, float]:
            start, read_before = time.monotonic(), reads(d)
            out = complete(d.url, legit, kv_transfer_params=prefill_only(fresh, legit))
            return out, time.monotonic() - start, reads(d) - read_before

        attack = lambda: complete(d.url, ATTACKER, max_tokens=1, kv_transfer_params=forged(template))  # noqa: E731
        health, answers, (out, took, read) = under_load(d, attack, 4, 96, legit_request)  # 96 > MAX_PEERS
        assert text(out) == expected and read == 1, (read, fresh.output())  # loaded from the prefill, not computed
        assert all(text(a) for a in answers)  # every forged request was answered (by recompute)
        refused = stats(d)["kv_peer_jobs_refused_total"]
        print(
            f"legit PD request during the attack: {took * 1000:.0f} ms; {len(answers)} forged requests; /health "
            f"max {max(health) * 1000:.0f} ms over {len(health)} probes (same load without params: max "
            f"{max(baseline) * 1000:.0f} ms); {refused:.0f} peer jobs refused"
        )
        assert max(health) < HEALTH_S, (sorted(health)[-5:], sorted(baseline)[-5:])
        assert_clean(p, fresh, d)
        assert stats(p)["kv_leases_held"] == stats(fresh)["kv_leases_held"] == 0
    finally:
        fresh.stop()
