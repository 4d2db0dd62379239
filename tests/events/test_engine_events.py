"""KV events through the offline `LLM`: one batch per step that changed the cache, the engine's cached set equal to
the batches replayed; a publisher thread that dies shows in `dead_threads()` and the engine keeps generating."""

from __future__ import annotations

import hashlib
import time

import cbor2
import msgpack
import pytest
import zmq

from hybridkv import LLM, SamplingParams
from hybridkv.events import publisher as publisher_module

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(4, 104))  # 100 tokens: 6 full blocks


@pytest.fixture
def llm(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "t"}
    # Free chunks (not float32's batch-invariant default): every full block is published, decode blocks too, so
    # the steps below each change the cache.
    engine = LLM(kv_cache_memory="4MiB", max_model_len=512, kv_events_config=config, batch_invariant=False)
    engine.endpoint = endpoint
    yield engine
    engine.engine.shutdown()


def test_each_step_that_changes_the_cache_is_one_batch(llm):
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.connect(llm.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        time.sleep(0.3)
        llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        # The prefill stored blocks 0-5 and the decode step that computed token 112 block 6: two batches, each sent
        # when its step ended (not when someone asked).
        assert llm.engine.kv_publisher.last_seq == 1
        state = llm.engine.kv_events_state()
        cached: dict[int, set[int]] = {}
        seqs = []
        while len(seqs) <= state["last_seq"]:
            assert sub.poll(5000), f"batches {seqs}, last {state['last_seq']}"
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for e in msgpack.unpackb(payload)[1]:
                cached.setdefault(e["group_idx"], set()).update(e["block_hashes"])
        assert seqs == list(range(state["last_seq"] + 1))
        expected = {int(g): {int(x[-16:], 16) for x in hs} for g, hs in state["cached"]["GPU"].items()}
        assert cached == expected and len(expected[0]) == 7
    finally:
        ctx.destroy(linger=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_publisher_is_reported_and_generation_goes_on(llm, monkeypatch):
    def boom(*args, **kwargs):
        raise SystemExit("injected publisher failure")

    monkeypatch.setattr(publisher_module, "encode_batch", boom)
    first = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    llm.engine.kv_publisher._thread.join(5)
    assert llm.engine.dead_threads() == ["kv-events"]
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == first


def test_events_off_means_no_publisher():
    llm = LLM(kv_cache_memory="4MiB", max_model_len=512, kv_events_config={"enable_kv_cache_events": False})
    assert llm.engine.kv_publisher is None and llm.engine.kv.events is None
    assert llm.engine.kv_events_state() is None and llm.engine.dead_threads() == []


def vllm_ids(tokens: list[int], block_size: int, seed: str) -> list[int]:
    """vLLM's sha256_cbor ids, written from its documented rule (not our code): root sha256(cbor(seed)), each block
    sha256(cbor([parent, tokens, None])), published as the digest's low 64 bits."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    ids = []
    for b in range(len(tokens) // block_size):
        parent = hashlib.sha256(cbor2.dumps([parent, tokens[b * block_size : (b + 1) * block_size], None])).digest()
        ids.append(int.from_bytes(parent[-8:], "big"))
    return ids


def test_with_vllms_algorithm_the_published_ids_are_vllms(tmp_path, monkeypatch):
    """--prefix-caching-hash-algo sha256_cbor with PYTHONHASHSEED=0: a router recomputing vLLM's ids from the
    prompt finds every stored block (and the ids chain from the published parent)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    endpoint = f"ipc://{tmp_path}/kv"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "t"}
    llm = LLM(kv_cache_memory="4MiB", max_model_len=512, kv_events_config=config, batch_invariant=False,
              prefix_caching_hash_algo="sha256_cbor")  # fmt: skip
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        time.sleep(0.3)
        llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        stored = []
        while len(stored) < 2:
            assert sub.poll(5000), f"got {len(stored)} batches"
            events = msgpack.unpackb(sub.recv_multipart()[2])[1]
            stored += [e for e in events if e["type"] == "BlockStored" and e["group_idx"] == 0]  # full attention
        tokens = [t for e in stored for t in e["token_ids"]]
        assert tokens[:100] == PROMPT and len(tokens) == 112
        assert [h for e in stored for h in e["block_hashes"]] == vllm_ids(tokens, 16, "0")
        assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    finally:
        ctx.destroy(linger=0)
        llm.engine.shutdown()
