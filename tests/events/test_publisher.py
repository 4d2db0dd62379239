"""The publisher on real ZMQ sockets (ipc, in a temp dir): live framing and sequence numbers, replay from a start
seq with vLLM's reply layout, hostile replay requests answered or ignored without hurting the thread, and the
config's vLLM keys and errors. The subscriber side is plain pyzmq + msgpack, written from vLLM's documented schema."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from hybridkv.events import publisher as publisher_module
from hybridkv.events.config import KVEventsConfig
from hybridkv.events.publisher import ZmqEventPublisher
from hybridkv.events.wire import encode_batch, external_hash
from hybridkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.kv.hashing import hash_block
from tests.procs import free_port

END = (-1).to_bytes(8, "big", signed=True)
GROUPS = {0: ("full_attention", None), 1: ("sliding_window", 64)}


def h(i: int) -> bytes:
    return hash_block(None, [i])


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


@pytest.fixture
def pub(endpoints):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoints[0], replay_endpoint=endpoints[1], topic="kv")
    p = ZmqEventPublisher(cfg, GROUPS)
    yield p
    p.shutdown()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # the subscription reaches the PUB socket before anything is published
    return sub


def replay(ctx: zmq.Context, endpoint: str, *frames: bytes) -> list[list[bytes]]:
    """Send one request from a DEALER; the replies up to the end marker (or until 2 s of silence)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart(list(frames))
    out = []
    while dealer.poll(2000):
        reply = dealer.recv_multipart()
        out.append(reply)
        if reply[2] == END:
            break
    dealer.close(linger=0)
    return out


def stored(i: int, group: int = 0) -> BlockStored:
    return BlockStored((h(i), h(i + 1)), h(i - 1) if i else None, tuple(range(32)), 16, group)


def test_live_batches_carry_topic_seq_and_vllms_schema(pub, endpoints, ctx):
    sub = subscribe(ctx, endpoints[0])
    pub.publish([stored(0), stored(0, group=1)])
    pub.publish([BlockRemoved((h(0),), 1), AllBlocksCleared()])
    got = [sub.recv_multipart() for _ in range(2)]
    assert [(t, int.from_bytes(s, "big")) for t, s, _ in got] == [(b"kv", 0), (b"kv", 1)]
    ts, events, rank = msgpack.unpackb(got[0][2])
    assert abs(ts - time.time()) < 60 and rank == 0
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [external_hash(h(0)), external_hash(h(1))],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert (events[1]["group_idx"], events[1]["kv_cache_spec_kind"], events[1]["kv_cache_spec_sliding_window"]) == (
        1, "sliding_window", 64)  # fmt: skip
    _, events, _ = msgpack.unpackb(got[1][2])
    assert events == [
        {"type": "BlockRemoved", "block_hashes": [external_hash(h(0))], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ]
    assert external_hash(h(0)) == int.from_bytes(h(0), "big") & (2**64 - 1)  # vLLM's int form of a hash
    assert pub.last_seq == 1


def test_replay_sends_buffered_batches_from_the_start_seq_then_the_end_marker(pub, endpoints, ctx):
    for i in range(5):
        pub.publish([stored(i)])
    deadline = time.monotonic() + 5
    while pub.published < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    replies = replay(ctx, endpoints[1], b"", (2).to_bytes(8, "big"))
    assert [r[0] for r in replies] == [b""] * 4
    assert [(r[1], int.from_bytes(r[2], "big")) for r in replies[:-1]] == [(b"kv", 2), (b"kv", 3), (b"kv", 4)]
    assert msgpack.unpackb(replies[0][3])[1][0]["block_hashes"][0] == external_hash(h(2))
    assert replies[-1] == [b"", b"", END, b""]


def test_a_small_buffer_keeps_the_newest_batches(endpoints, ctx):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoints[0], replay_endpoint=endpoints[1],
                         buffer_steps=2, topic="kv")  # fmt: skip
    p = ZmqEventPublisher(cfg, GROUPS)
    try:
        for i in range(4):
            p.publish([stored(i)])
        while p.published < 4:
            time.sleep(0.01)
        seqs = [int.from_bytes(r[2], "big") for r in replay(ctx, endpoints[1], b"", bytes(8))[:-1]]
        assert seqs == [2, 3]  # 0 and 1 left the buffer: the subscriber sees the gap and resynchronizes
    finally:
        p.shutdown()


@pytest.mark.parametrize(
    "frames",
    [
        (b"", b"abc"),  # a start seq of 3 bytes
        (b"", b"\x00" * 9),  # 9 bytes
        (b"", (0).to_bytes(8, "big"), b"extra"),  # a frame too many
        (b"",),  # no start seq
        (b"", (2**64 - 1).to_bytes(8, "big")),  # past every batch
        (b"", (-5).to_bytes(8, "big", signed=True)),  # "negative": read unsigned, past every batch
    ],
)
def test_hostile_replay_requests_get_only_the_end_marker(pub, endpoints, ctx, frames):
    pub.publish([stored(0)])
    while pub.published < 1:
        time.sleep(0.01)
    assert replay(ctx, endpoints[1], *frames) == [[b"", b"", END, b""]]
    assert pub.alive()


def test_requests_without_an_envelope_or_oversized_are_dropped_and_replay_still_works(pub, endpoints, ctx):
    pub.publish([stored(0)])
    while pub.published < 1:
        time.sleep(0.01)
    assert replay(ctx, endpoints[1], (0).to_bytes(8, "big")) == []  # no empty delimiter: nothing to answer on
    assert replay(ctx, endpoints[1], b"", b"x" * 100_000) == []  # beyond MAXMSGSIZE: the connection is dropped
    for _ in range(50):  # a flood of garbage does not stop live publishing
        d = ctx.socket(zmq.DEALER)
        d.connect(endpoints[1])
        d.send_multipart([b"junk", b"", b"more"])
        d.close(linger=0)
    replies = replay(ctx, endpoints[1], b"", bytes(8))
    assert [int.from_bytes(r[2], "big") for r in replies] == [0, -1 & (2**64 - 1)]
    assert pub.alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_publisher_thread_shows_and_publish_never_blocks(pub, monkeypatch):
    def boom(*args, **kwargs):
        raise SystemExit("injected")  # not an Exception: the thread's own handler does not catch it

    monkeypatch.setattr(publisher_module, "encode_batch", boom)
    pub.publish([stored(0)])
    pub._thread.join(5)
    assert not pub.alive()
    t0 = time.monotonic()
    for i in range(10):
        pub.publish([stored(i)])
    assert time.monotonic() - t0 < 1


def test_a_full_queue_drops_the_batch_and_its_seq_stays_a_gap(endpoints, monkeypatch):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoints[0], max_queue_size=1)
    p = ZmqEventPublisher(cfg, GROUPS)
    try:
        release = []
        monkeypatch.setattr(p, "_send", lambda *a: release.append(a) or time.sleep(1))  # a stuck thread
        p.publish([stored(0)])
        time.sleep(0.2)  # taken by the thread, which now hangs in _send
        p.publish([stored(1)])  # fills the queue
        p.publish([stored(2)])  # dropped
        assert p.queue_full_drops == 1 and p.last_seq == 2
    finally:
        p.shutdown()


def test_encode_batch_is_plain_msgpack():
    payload = encode_batch(1.5, [stored(3, group=1)], GROUPS, data_parallel_rank=0)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank, events[0]["parent_block_hash"]) == (1.5, 0, external_hash(h(2)))


# ---- config ------------------------------------------------------------------------------------------------


def test_config_defaults_are_vllms():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    got = (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic)
    assert got == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert cfg.enabled and cfg.binds
    assert not KVEventsConfig.parse("{}").enabled and KVEventsConfig.parse("{}").publisher == "null"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled
    remote = KVEventsConfig(endpoint="tcp://router.local:5557", allow_remote=True)
    assert not remote.binds and remote.exposed  # vLLM's rule: a host name connects
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").binds


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown keys: endpont"),
        ('{"enable_kv_cache_events": "yes"}', "true or false"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "http://x:1"}', "must start with one of tcp://"),
        ('{"endpoint": "tcp://*"}', "needs a port"),
        ('{"endpoint": "tcp://*:65536"}', "needs a port"),
        ('{"replay_endpoint": 5558}', "must be a string"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
        ('{"hwm": true}', "hwm must be a positive integer"),
        ('{"max_queue_size": -1}', "max_queue_size must be a positive integer"),
        ('{"replay_endpoint": "tcp://*:5557"}', "must differ from endpoint"),
        ('{"endpoint": "tcp://router.local:5557"}', "leaves this host.*allow_remote"),
        ('{"replay_endpoint": "tcp://10.0.0.5:5558"}', "leaves this host.*allow_remote"),
        ('{"allow_remote": 1}', "allow_remote must be true or false"),
    ],
)
def test_bad_configs_say_what_to_change(raw, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(raw)


def test_a_wildcard_binds_loopback_unless_remote_subscribers_are_allowed():
    """The stream carries prompts' token ids: vLLM's default endpoint (tcp://*:5557) listens on loopback only
    here; `allow_remote` binds every interface, and only then is the config `exposed` (start-up warns)."""
    for allow, address in ((False, "127.0.0.1"), (True, "0.0.0.0")):
        port, replay = free_port(), free_port()
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                             replay_endpoint=f"tcp://*:{replay}", allow_remote=allow)  # fmt: skip
        pub = ZmqEventPublisher(cfg, GROUPS)
        try:
            assert pub._pub.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://{address}:{port}"
            assert pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode() == f"tcp://{address}:{replay}"
            assert cfg.exposed is allow
        finally:
            pub.shutdown()
    assert not KVEventsConfig(endpoint="tcp://127.0.0.1:5557").exposed
    assert KVEventsConfig(endpoint="tcp://[::]:5557").bind_endpoint("tcp://[::]:5557") == "tcp://[::1]:5557"


def test_a_port_in_use_is_a_value_error():
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    first = ZmqEventPublisher(cfg, GROUPS)
    try:
        with pytest.raises(ValueError, match="cannot open tcp://"):
            ZmqEventPublisher(cfg, GROUPS)
    finally:
        first.shutdown()
