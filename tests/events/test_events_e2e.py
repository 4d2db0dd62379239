"""KV events from a real `hybridkv serve` process, read by a plain pyzmq + msgpack subscriber written from vLLM's
documented schema (it imports nothing of ours to decode): one subscriber from the start, one that joins late and
fetches what it missed from the replay socket. Requests share prefixes and evict (a 4 MiB cache). Each subscriber
rebuilds the cached block set per (medium, group) from the batches and must get exactly what /admin/kv reports;
every stored run must be a true chain segment (its hashes recompute from its parent and its tokens)."""

from __future__ import annotations

import json
import random
import time

import httpx
import msgpack
import pytest
import zmq

from hybridkv.kv.hashing import hash_block
from tests.procs import Process, free_port

# Free chunks (not float32's batch-invariant default): every full block is published, decode blocks too, so the
# batch counts below hold; batch-invariant mode publishes only whole split units of prompts.
ENGINE = ["--threads", "1", "--kv-cache-memory", "4MiB", "--max-model-len", "512", "--enable-admin",
          "--no-batch-invariant"]  # fmt: skip
TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def u64(block_hash: bytes) -> int:
    """How vLLM (and so we) put a block hash on the wire: its low 64 bits."""
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


class Subscriber:
    """A KV-event consumer as a router would write one: SUB for live batches, DEALER for replay."""

    def __init__(self, ctx: zmq.Context, pub_port: int, replay_port: int) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{pub_port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.batches: dict[int, list[dict]] = {}  # seq -> the batch's events
        self.live_seqs: list[int] = []
        time.sleep(0.5)  # the subscription reaches the publisher before we rely on it

    def _add(self, seq: int, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        self.batches[seq] = events

    def drain(self, until_seq: int, timeout: float = 30) -> None:
        """Read live batches until `until_seq` has arrived."""
        deadline = time.monotonic() + timeout
        while until_seq not in self.batches:
            assert time.monotonic() < deadline, f"batch {until_seq} never arrived (have {sorted(self.batches)[-3:]})"
            if self.sub.poll(200):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                self.live_seqs.append(int.from_bytes(seq, "big"))
                self._add(self.live_seqs[-1], payload)

    def fetch_missed(self) -> int:
        """Ask the replay socket for everything from the first missing batch on; returns how many came."""
        start = next(s for s in range(max(self.batches, default=-1) + 2) if s not in self.batches)
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        n = 0
        while True:
            assert self.replay.poll(10_000), "the replay never ended"
            empty, topic, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return n
            assert topic == TOPIC
            self._add(int.from_bytes(seq, "big"), payload)
            n += 1

    def cached(self) -> dict[tuple[str, int], set[int]]:
        """Replay every batch in order: (medium, group) -> cached block hashes. The batches must be gapless."""
        assert sorted(self.batches) == list(range(len(self.batches))), "a batch is missing"
        cached: dict[tuple[str, int], set[int]] = {}
        for seq in range(len(self.batches)):
            for e in self.batches[seq]:
                if e["type"] == "BlockStored":
                    cached.setdefault((e["medium"], e["group_idx"]), set()).update(e["block_hashes"])
                elif e["type"] == "BlockRemoved":
                    cached.setdefault((e["medium"], e["group_idx"]), set()).difference_update(e["block_hashes"])
                else:
                    assert e == {"type": "AllBlocksCleared"}
                    cached.clear()
        return {k: v for k, v in cached.items() if v}

    def events(self, kind: str) -> list[dict]:
        return [e for seq in sorted(self.batches) for e in self.batches[seq] if e["type"] == kind]


def reported(p: Process) -> tuple[int, dict[tuple[str, int], set[int]]]:
    state = httpx.get(f"{p.url}/admin/kv", timeout=30).json()
    assert state["integrity"] == "ok", state
    ev = state["kv_events"]
    assert ev["dropped_batches"] == 0
    cached = {
        (medium, int(g)): {u64(bytes.fromhex(x)) for x in hashes}
        for medium, groups in ev["cached"].items()
        for g, hashes in groups.items()
        if hashes
    }
    return ev["last_seq"], cached


def check_chains(stored: list[dict]) -> None:
    """Each stored run's hashes follow from its parent and its tokens (the full hashes are recomputed from the
    first block of each prompt on, so a wrong parent, token or block size shows)."""
    full: dict[int, bytes] = {}
    for e in stored:
        bs, tokens = e["block_size"], e["token_ids"]
        assert len(tokens) == bs * len(e["block_hashes"]), e
        parent = None if e["parent_block_hash"] is None else full[e["parent_block_hash"]]
        for i, h in enumerate(e["block_hashes"]):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            assert u64(parent) == h, f"block {i} of a stored run does not follow from its parent and tokens"
            full[h] = parent


def complete(p: Process, prompts: list[list[int]], salt: str | None = None) -> None:
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body |= {"cache_salt": salt} if salt else {}
    r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text


def serve(pub: int, replay: int, *extra: str) -> Process:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": TOPIC.decode()}  # fmt: skip
    return Process("serve", *ENGINE, "--kv-events-config", json.dumps(config), *extra, timeout=300)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_subscribers_rebuild_exactly_the_cached_blocks_the_engine_reports(ctx):
    rng = random.Random(0)
    shared = [rng.randrange(4, 400) for _ in range(100)]
    pub, replay = free_port(), free_port()
    p = serve(pub, replay)
    try:
        early = Subscriber(ctx, pub, replay)
        # Round 1: prompts sharing a 100-token prefix, one after another so the later ones hit the cache.
        for n in (40, 70, 25):
            complete(p, [shared + [rng.randrange(4, 400) for _ in range(n)]])
        # A salted tenant's prompt, twice (the second a prefix hit): never published, in any record.
        secret = [rng.randrange(4, 400) for _ in range(64)]
        complete(p, [secret], salt="tenant-b")
        complete(p, [secret + [5, 6]], salt="tenant-b")
        first_seq, _ = reported(p)
        assert first_seq >= 3  # a batch per step that changed the cache, sent as the step ended
        late = Subscriber(ctx, pub, replay)
        # Round 2: enough distinct prompts to evict round 1 from 127 blocks shared by two groups.
        for _ in range(4):
            complete(p, [[rng.randrange(4, 400) for _ in range(rng.randrange(150, 300))] for _ in range(3)])
        complete(p, [shared + [1, 2, 3] * 20])
        last_seq, engine_cached = reported(p)
        assert last_seq > first_seq >= 0
        early.drain(last_seq)
        late.drain(last_seq)
        assert min(late.live_seqs) > first_seq  # it joined late: round 1 reached it only through the replay
        assert late.fetch_missed() >= first_seq + 1
        early.fetch_missed()  # a gap (a batch sent before its subscription took) is filled the same way
        for sub in (early, late):
            assert sub.cached() == engine_cached
            check_chains(sub.events("BlockStored"))
            assert not any(e["token_ids"][:16] == secret[:16] for e in sub.events("BlockStored")), "salted published"
        assert set(engine_cached) == {("GPU", 0), ("GPU", 1)}
        removed = early.events("BlockRemoved")
        assert sum(len(e["block_hashes"]) for e in removed) > 50, "the run evicted nothing: make it bigger"
        stored = early.events("BlockStored")
        assert any(e["parent_block_hash"] is not None for e in stored)  # runs after a prefix hit
        kinds = {(e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window")) for e in stored}
        assert kinds == {(0, "full_attention", None), (1, "sliding_window", 16)}
        assert {e["medium"] for e in stored + removed} == {"GPU"}
        assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200
    finally:
        p.stop()


def test_the_cpu_offload_tier_reports_its_blocks_with_medium_cpu(ctx):
    """With --kv-offload-cpu, blocks stored to CPU memory come as medium "CPU" (vLLM's name), evicted ones go, and a
    prompt loaded back from the tier is what the subscriber still sees there."""
    rng = random.Random(1)
    pub, replay = free_port(), free_port()
    # The device holds 63 blocks (about 31 block positions per group), the CPU tier 128 (64 positions).
    p = serve(pub, replay, "--kv-cache-memory", "2MiB", "--max-model-len", "256", "--kv-offload-cpu", "4MiB")
    try:
        sub = Subscriber(ctx, pub, replay)
        first = [rng.randrange(4, 400) for _ in range(200)]

        def distinct_round() -> None:
            complete(p, [[rng.randrange(4, 400) for _ in range(rng.randrange(180, 240))] for _ in range(3)])

        complete(p, [first])
        distinct_round()  # `first` leaves the device but stays in the CPU tier
        complete(p, [first[:160] + [7] * 40])  # its first 10 blocks load back from the CPU tier
        distinct_round()  # the CPU tier evicts too
        last_seq, engine_cached = reported(p)
        sub.drain(last_seq)
        sub.fetch_missed()
        assert sub.cached() == engine_cached
        assert {m for m, _ in engine_cached} == {"GPU", "CPU"}
        check_chains(sub.events("BlockStored"))
        cpu_removed = [e for e in sub.events("BlockRemoved") if e["medium"] == "CPU"]
        assert cpu_removed, "the CPU tier evicted nothing: make the run bigger"
        connector = httpx.get(f"{p.url}/admin/kv", timeout=30).json()["connector"]
        assert connector["kv_offload_cpu_to_device_blocks_total"] > 0  # a load from the tier happened
    finally:
        p.stop()


def test_kv_event_sources_names_the_sockets_a_router_reads(ctx):
    """vLLM's discovery route: with ports 0 the publisher binds ephemeral ports on loopback, and GET
    /kv_event_sources names them; a subscriber that knows nothing else reads live and replayed batches there."""
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0",
              "topic": TOPIC.decode()}  # fmt: skip
    p = Process("serve", *ENGINE, "--kv-events-config", json.dumps(config), timeout=300)
    try:
        sources = httpx.get(f"{p.url}/kv_event_sources", timeout=10).json()
        assert list(sources) == ["0"]  # keyed by data-parallel rank, as vLLM's
        source = sources["0"]
        assert source["topic"] == TOPIC.decode() and source["enable_kv_cache_events"] is True
        # What vllm-router checks before it subscribes to a discovered source.
        assert (source["publisher"], source["encoding"], source["schema_version"]) == ("zmq", "msgpack", 1)
        ports = []
        for key in ("endpoint", "replay_endpoint"):
            host, port = source[key].removeprefix("tcp://").rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0, source
            ports.append(int(port))
        sub = Subscriber(ctx, *ports)
        complete(p, [list(range(4, 100))])
        last_seq, _ = reported(p)
        sub.drain(last_seq)
        assert sub.fetch_missed() >= 0 and sub.events("BlockStored")
    finally:
        p.stop()
    plain = Process("serve", *ENGINE[:-1])
    try:
        assert httpx.get(f"{plain.url}/kv_event_sources", timeout=10).json() == {}
    finally:
        plain.stop()
