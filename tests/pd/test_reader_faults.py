"""NixlReader's read-timeout paths with a fake transport and peer I/O: no NIXL, no processes. A read that
outlives kv_transfer_timeout_s is cancelled; while NIXL refuses to cancel, the blocks stay held (the load is not
reported), and they are handed back the moment NIXL lets go. A lease that ended before the read fails at once."""

import json
from dataclasses import replace
from pathlib import Path

from hybridkv.connectors.base import ConnectorEvents
from hybridkv.connectors.pd.descriptors import Placement
from hybridkv.connectors.pd.peer_io import PeerResult, ResultKind
from hybridkv.connectors.pd.protocol import HandshakeReply, HandshakeRequest
from hybridkv.connectors.pd.reader import NixlReader, Peer
from hybridkv.connectors.pd.transfer_params import RemotePrefill, prompt_hash
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request

CONFIG = json.loads((Path(__file__).parents[2] / "examples/configs/gemma4-e2b-like.json").read_text())


class FakeTransport:
    device_id = 0

    def __init__(self, state: str, refusals: int) -> None:
        self.current, self.refusals, self.released = state, refusals, 0

    reads = 0

    def add_peer(self, metadata: bytes) -> str:
        return "agent"

    def read(self, descs, agent):
        self.reads += 1
        return "handle"

    def state(self, handle) -> str:
        return self.current

    def release(self, handle) -> bool:
        if self.refusals:
            self.refusals -= 1
            return False
        self.released += 1
        return True


class FakeIO:
    def __init__(self, lease_held: bool = True) -> None:
        self.tracked, self.released, self.posted = [], [], []
        self.lease_held = lease_held

    def confirm(self, request_id) -> None:
        self.posted.append(PeerResult(ResultKind.LEASE, request_id, self.lease_held))

    def track(self, request_id, target) -> None:
        self.tracked.append(request_id)

    def handshake(self, engine_id, host, port, message) -> None:
        pass

    def release_tracked(self, request_id, report) -> None:
        self.released.append((request_id, report))

    def results(self):
        out, self.posted = self.posted, []
        return out


def reader(transport: FakeTransport, io: FakeIO, timeout_s: float) -> NixlReader:
    plan = plan_from_hf_config(CONFIG, CacheConfig(64 << 20, 1024), block_size=16, dtype="float32")
    here = Placement.of(plan, [(i + 1) << 40 for i in range(len(plan.buffer_sizes))])
    r = NixlReader(plan, transport, here, HandshakeRequest("0" * 64, "decode-0"), io, timeout_s)
    r.peers["prefill-0"] = Peer("127.0.0.1", 1, "agent", here, plan.num_blocks)  # handshake already done
    return r


def start(r: NixlReader) -> Request:
    prompt = list(range(4, 68))
    params = RemotePrefill(
        "prefill-0", "127.0.0.1", 1, "p-1", "0" * 32, tuple((1, 2, 3, 4) for _ in r.plan.groups), len(prompt),
        prompt_hash(prompt), expires_at=0,
    )  # fmt: skip
    req = Request("r-1", prompt, SamplingParams(), 16, kv_transfer_params=params)
    req.num_external_tokens = r.num_external_tokens(req, 0)
    r.start_load(req, [[5, 6, 7, 8] for _ in r.plan.groups], 0)
    return req


def test_a_read_past_its_timeout_fails_once_nixl_lets_go_and_holds_blocks_until_then():
    transport, io = FakeTransport("PROC", refusals=2), FakeIO()
    r = reader(transport, io, timeout_s=0.0)
    start(r)
    polls = []
    for _ in range(4):
        events = ConnectorEvents()
        r.poll(events)
        polls.append(dict(events.loaded))
    # Poll 1 starts the read. Polls 2 and 3: past the timeout, but NIXL refuses to cancel, so nothing is reported
    # and the blocks stay with the read. Poll 4: cancelled, so the load fails and the lease is given up.
    assert polls == [{}, {}, {}, {"r-1": False}]
    assert transport.released == 1 and io.released == [("r-1", False)]
    assert r.stats["kv_transfer_failures_total"] == 1 and not r.loads


def test_an_aborted_read_frees_its_blocks_only_after_the_read_is_over():
    transport, io = FakeTransport("PROC", refusals=0), FakeIO()
    r = reader(transport, io, timeout_s=60.0)
    start(r)
    r.poll(ConnectorEvents())  # the read starts
    assert r.abort("r-1") is False  # still in flight: the scheduler keeps the blocks
    events = ConnectorEvents()
    r.poll(events)
    assert events.released == []
    transport.current = "DONE"
    events = ConnectorEvents()
    r.poll(events)
    assert events.released == ["r-1"] and not r.loads


def test_a_lease_that_already_ended_fails_fast_without_a_read():
    """The decoder confirms the lease before reading: a peer that let the blocks go would not drive the read,
    which would then wait for its whole timeout."""
    transport, io = FakeTransport("PROC", refusals=0), FakeIO(lease_held=False)
    r = reader(transport, io, timeout_s=60.0)
    start(r)
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-1": False} and transport.reads == 0
    assert io.released == [("r-1", False)] and r.stats["kv_transfer_failures_total"] == 1


def test_a_handshake_answered_by_another_engine_fails_the_load_and_caches_nothing():
    """A relay or a restarted instance answering for an engine id it is not: the peer is not learned."""
    transport, io = FakeTransport("DONE", refusals=0), FakeIO()
    r = reader(transport, io, timeout_s=60.0)
    known = r.peers.pop("prefill-0")
    req = start(r)
    assert r.loads[req.request_id].state.value == "handshake"
    impostor = HandshakeReply("someone-else", b"meta", known.placement, known.num_blocks, "packed")
    io.posted.append(PeerResult(ResultKind.HANDSHAKE, "prefill-0", True, handshake=impostor, address=("127.0.0.1", 1)))
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-1": False} and "is engine someone-else" in events.errors["r-1"]
    assert "prefill-0" not in r.peers and transport.reads == 0
    other_layers = replace(impostor, engine_id="prefill-0", placement=Placement({0: (1, 2)}))
    start(r)
    io.posted.append(
        PeerResult(ResultKind.HANDSHAKE, "prefill-0", True, handshake=other_layers, address=("127.0.0.1", 1))
    )
    events = ConnectorEvents()
    r.poll(events)
    assert "placement names other layers" in events.errors["r-1"] and "prefill-0" not in r.peers


def test_a_failed_handshake_fails_only_the_loads_that_named_its_address():
    """Without a secret anyone can name a real engine id at a silent port: that must not fail its real loads."""
    transport, io = FakeTransport("DONE", refusals=0), FakeIO()
    r = reader(transport, io, timeout_s=60.0)
    known = r.peers.pop("prefill-0")
    genuine = start(r)
    forged = Request("r-2", genuine.prompt_token_ids, SamplingParams(), 16)
    forged.kv_transfer_params = replace(genuine.kv_transfer_params, port=9)
    forged.num_external_tokens = r.num_external_tokens(forged, 0)
    r.start_load(forged, [[9, 10, 11, 12] for _ in r.plan.groups], 0)
    assert r._asked == {("prefill-0", "127.0.0.1", 1), ("prefill-0", "127.0.0.1", 9)}  # two handshakes, not one
    io.posted.append(PeerResult(ResultKind.HANDSHAKE, "prefill-0", False, "timed out", address=("127.0.0.1", 9)))
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-2": False} and r.loads["r-1"].state.value == "handshake"
    reply = HandshakeReply("prefill-0", b"meta", known.placement, known.num_blocks, "packed")
    io.posted.append(PeerResult(ResultKind.HANDSHAKE, "prefill-0", True, handshake=reply, address=("127.0.0.1", 1)))
    r.poll(ConnectorEvents())
    assert r.peers["prefill-0"].port == 1 and r.loads["r-1"].state.value == "confirming"


def test_remote_block_ids_outside_the_peers_pool_fail_without_a_read():
    """The handshake told the pool's size: ids past it (a stale or forged table) never become descriptors."""
    transport, io = FakeTransport("DONE", refusals=0), FakeIO()
    r = reader(transport, io, timeout_s=60.0)
    r.peers["prefill-0"] = replace(r.peers["prefill-0"], num_blocks=4)  # ids 1..4 in start(): 4 is outside
    start(r)
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-1": False} and "outside the peer's pool of 4" in events.errors["r-1"]
    assert transport.reads == 0 and io.posted == [] and r.stats["kv_transfer_failures_total"] == 1


def test_the_transfer_clock_counts_from_submission():
    """Loopback UCX moves most bytes inside the submitting read() call: kv_transfer_seconds must include it."""
    import time

    class SlowSubmit(FakeTransport):
        def read(self, descs, agent):
            time.sleep(0.05)  # the bytes move here
            return super().read(descs, agent)

    transport = SlowSubmit("DONE", refusals=0)
    r = reader(transport, FakeIO(), timeout_s=30.0)
    start(r)
    for _ in range(3):
        r.poll(ConnectorEvents())
    assert transport.reads == 1 and r.stats["kv_transfer_reads_total"] == 1
    assert r.stats["kv_transfer_seconds_total"] >= 0.05


def test_a_read_whose_lease_ended_before_release_is_not_reported_loaded():
    """The read completed, but the release reply says the lease was gone: the prefill instance may have reused
    those blocks mid-read, so the load fails (the request recomputes) instead of trusting freed KV."""
    transport, io = FakeTransport("DONE", refusals=0), FakeIO()
    r = reader(transport, io, timeout_s=60.0)
    start(r)
    r.poll(ConnectorEvents())  # confirmed, read started
    r.poll(ConnectorEvents())  # read done: release asked for, with a report
    assert transport.reads == 1 and io.released == [("r-1", True)]
    io.posted.append(PeerResult(ResultKind.RELEASE, "r-1", False))  # the lease had expired at release
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-1": False} and "lease ended" in events.errors["r-1"]
    assert r.stats["kv_transfer_failures_total"] == 1 and not r.loads
    start(r)  # the same read with the lease held to the end is trusted
    r.poll(ConnectorEvents())
    r.poll(ConnectorEvents())
    io.posted.append(PeerResult(ResultKind.RELEASE, "r-1", True))
    events = ConnectorEvents()
    r.poll(events)
    assert events.loaded == {"r-1": True} and not events.errors and r.stats["kv_transfer_failures_total"] == 1
