"""KV events through the offline `LLM`: one batch per step that changed the cache, the engine's cached set equal to
the batches replayed; a publisher thread that dies shows in `dead_threads()` and the engine keeps generating."""

from __future__ import annotations

import time

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
