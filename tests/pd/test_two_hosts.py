"""Prefill and decode on two hosts for real: each instance in its own network namespace, its side channel and HTTP
server on its end of a veth pair, the proxy outside both (topology: tests/pd/netns_util.py). The KV the decoder
reads crosses that veth over UCX's TCP transport, and the kernel's byte counters on both ends show it: at least
as many bytes as the decoder says it read. The answers equal one instance's.

Needs root and iproute2; skips without them (or without NIXL), but under CI (CI=true) a machine that cannot
build the namespaces fails the test instead.
"""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.netns_util import Host, TwoHosts
from tests.pd.pd_util import ENGINE, HELDOUT, assert_clean, complete, proxy, single_instance, transfers

MODEL = str(DEFAULT_MODEL_DIR)
PROMPTS = [it["prompt"] for it in HELDOUT[64:70]]

# Both "hosts" share one kernel. Given UCX's shared-memory transports (sm: posix/sysv shared memory and CMA's
# process_vm_readv, which work across network namespaces), UCX would see one machine and copy the prefill's KV
# memory to memory, and no byte would cross the veth. tcp,self is what two hosts without RDMA use; UCX binds to
# the device of the side channel's address (the veth) by itself.
UCX = {"UCX_TLS": "tcp,self"}


def args(host: Host, layout: str) -> list[str]:
    extra = {"side_channel_host": host.addr, "side_channel_port": 5600}
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return ["--model", MODEL, "--kv-layout", layout, *ENGINE, "--enable-admin", "--kv-transfer-config", json.dumps(ktc)]


@pytest.fixture(scope="module")
def two_hosts():
    """(net, prefill, decode, proxy, one instance's answers); everything stopped and both namespaces removed
    afterwards, failed or not."""
    net = TwoHosts.create()
    x = None
    try:
        env = {"HYBRIDKV_KV_SECRET": secrets.token_hex(16), **UCX}  # a side channel off loopback needs the secret
        p = net.serve(net.prefill, *args(net.prefill, "per-layer"), env=env)
        d = net.serve(net.decode, *args(net.decode, "packed"), env=env)
        expected = single_instance(MODEL, PROMPTS)  # while they start
        p.wait()
        d.wait()
        x = proxy(p, d)  # in the root namespace, on loopback
        yield net, p, d, x, expected
    finally:
        if x is not None:
            x.stop()
        net.close()


def test_the_kv_crosses_the_veth_between_two_namespaces(two_hosts):
    net, p, d, x, expected = two_hosts
    link = {"decode": net.decode.counters(), "prefill": net.prefill.counters()}
    uplink = net.decode.counters(net.decode.uplink)
    # Every prompt's KV read, none failed or recomputed:
    try:
        with transfers(d, at_least=len(PROMPTS)) as moved, ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda q: complete(x.url, q), PROMPTS))
    except AssertionError as e:  # say why the reads failed: the instances' logs
        raise AssertionError(f"{e}\nprefill:\n{p.output()}\ndecode:\n{d.output()}") from e
    assert [o["choices"][0]["text"] for o in outs] == expected, (p.output(), d.output())
    received = net.decode.counters()["rx_bytes"] - link["decode"]["rx_bytes"]
    sent = net.prefill.counters()["tx_bytes"] - link["prefill"]["tx_bytes"]
    http = net.decode.counters(net.decode.uplink)["rx_bytes"] - uplink["rx_bytes"]
    figures = f"kv_transfer_bytes {moved['bytes']:.0f}, link: decode rx {received}, prefill tx {sent}; uplink {http}"
    print(figures)
    assert received >= moved["bytes"] and sent >= moved["bytes"], figures
    assert http < moved["bytes"], figures  # the proxy's HTTP took the uplink; the KV did not
    assert_clean(p, d)
