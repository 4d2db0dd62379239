"""Engine vs transformers in float32: logits of prefill and every decode step within 1e-4, greedy tokens equal,
across layouts, batches of mixed lengths (shorter and longer than the window), prefix hits, chunked prefill,
preemption, and sliding windows that are not the block size. After every run the block pool is intact and empty."""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config
from hybridkv.request.sampling_params import SamplingParams
from tests.recording import record_logits
from tests.tiny_models import build

NEW_TOKENS = 64


@pytest.fixture(scope="module", params=["gemma4", "gemma4_k_eq_v", "llama", "qwen3", "mistral_sliding"])
def checkpoint(request, tmp_path_factory):
    pytest.importorskip("transformers")
    return request.param, build(request.param, tmp_path_factory.mktemp(request.param))


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 9, 16, 17, 40, 75][:n]  # around and well beyond the window of 16
    return [[rng.randrange(4, 512) for _ in range(k)] for k in lengths]


def greedy(llm: LLM, prompt_ids):
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0
    return outs


def run_engine(folder, prompt_ids, query_tile=None, **kw):
    llm = LLM(str(folder), dtype="float32", **kw)
    if query_tile is not None:  # small tiles: long prompts attend tile by tile (see runner/step_index.py)
        llm.engine.runner.query_tile = query_tile
    recorded = record_logits(llm)
    return llm, greedy(llm, prompt_ids), recorded


def reference_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = reference_logits.cache.get(folder)
    if model is None:
        model = reference_logits.cache[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


reference_logits.cache = {}


def check(folder, outs, recorded, prompt_ids):
    for out, p in zip(outs, prompt_ids):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == NEW_TOKENS
        ref = reference_logits(folder, p + tokens)  # row t predicts token t + 1
        ours = torch.stack(recorded[out.request_id])
        expected = ref[len(p) - 1 : len(p) - 1 + NEW_TOKENS]
        assert (ours - expected).abs().max().item() < 1e-4
        assert tokens == expected.argmax(-1).tolist()


@pytest.mark.parametrize("query_tile", [None, 7])
@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_batch_of_mixed_lengths(checkpoint, layout, query_tile):
    _, folder = checkpoint
    p = prompts()
    _, outs, rec = run_engine(folder, p, query_tile, kv_layout=layout)
    check(folder, outs, rec, p)


@pytest.mark.parametrize("query_tile", [None, 5])
def test_chunked_prefill(checkpoint, query_tile):
    _, folder = checkpoint
    p = prompts()
    _, outs, rec = run_engine(folder, p, query_tile, max_num_batched_tokens=24, max_model_len=256)
    check(folder, outs, rec, p)


@pytest.mark.parametrize("query_tile", [None, 6])
def test_prefix_cache_hits(checkpoint, query_tile):
    _, folder = checkpoint
    base = prompts(6)[-1]
    p = [base, base[:50] + [7, 8, 9], base + [11]]
    llm, outs, rec = run_engine(folder, p[:1], query_tile)
    check(folder, outs, rec, p[:1])
    # Same engine, second wave: the shared prefix is served from the cache.
    hits = []
    find = llm.engine.kv.find_cached_prefix
    llm.engine.kv.find_cached_prefix = lambda h, n: hits.append(find(h, n).num_tokens) or find(h, n)
    rec2 = record_logits(llm)
    outs2 = greedy(llm, p[1:])
    assert max(hits) >= 48
    check(folder, outs2, rec2, p[1:])


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(model name, sliding window) -> a checkpoint of that model with that window, each built once."""
    pytest.importorskip("transformers")
    built = {}

    def get(name: str, window: int):
        if (name, window) not in built:
            built[name, window] = build(name, tmp_path_factory.mktemp(f"{name}-w{window}"), sliding_window=window)
        return built[name, window]

    return get


# (sliding window, block size, layout, step token budget): a window smaller than a block, one spanning blocks with
# a remainder, and one not a multiple of the block size; chunked where windows slide inside a prefill.
WINDOWS = [(7, 4, "per-layer", 10), (40, 16, "packed", 24), (7, 16, "packed", None)]


@pytest.mark.parametrize(("window", "block_size", "layout", "budget"), WINDOWS)
@pytest.mark.parametrize("name", ["gemma4", "mistral_sliding"])
def test_sliding_windows_other_than_the_block_size(windowed, name, window, block_size, layout, budget):
    folder = windowed(name, window)
    p = prompts()
    kw = {} if budget is None else dict(max_num_batched_tokens=budget, max_model_len=256)
    llm, outs, rec = run_engine(folder, p, kv_layout=layout, block_size=block_size, **kw)
    groups = llm.engine.kv.plan.groups
    assert {g.sliding_window for g in groups} - {None} == {window} and {g.block_size for g in groups} == {block_size}
    check(folder, outs, rec, p)


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_tiny_gemma4_layouts_differ(tiny_gemma4, block_size):
    """The layout parametrizations on the shared tiny Gemma 4 test something only while per-layer and packed
    place its KV differently: per-layer in several buffers, more than one region per block of every group."""
    config = load_hf_config(tiny_gemma4)
    plans = {
        layout: plan_from_hf_config(
            config, CacheConfig(16 << 20, 256, kv_layout=layout), block_size=block_size, dtype="float32"
        )
        for layout in ("per-layer", "packed")
    }
    per_layer, packed = plans["per-layer"], plans["packed"]
    assert len(per_layer.buffer_sizes) > 1 == len(packed.buffer_sizes)
    for g in packed.groups:
        assert per_layer.descriptors_per_block(g.group_id) > 1 == packed.descriptors_per_block(g.group_id)
    # And it is still the model it stands for: sliding and full groups, two head sizes, KV-sharing layers.
    assert {g.kind for g in packed.groups} == {"full_attention", "sliding_window"}
    assert len({s.head_size for s in packed.specs if s is not None}) == 2 and packed.shared


def test_preemption_under_a_small_kv_budget(checkpoint):
    _, folder = checkpoint
    p = prompts()
    # Room for one request of max_model_len and two spare blocks: six requests must take turns. A small step
    # budget keeps sliding windows small too, so all-sliding models are squeezed as well.
    cache = CacheConfig(1 << 30, 160, max_num_batched_tokens=16)
    one = plan_from_hf_config(load_hf_config(folder), cache, block_size=16, dtype="float32")
    memory = one.bytes_per_block * (one.blocks_admitted_per_request + 3)
    llm, outs, rec = run_engine(folder, p, kv_cache_memory=memory, max_model_len=160, max_num_batched_tokens=16)
    assert llm.engine.scheduler.num_preemptions > 0
    check(folder, outs, rec, p)
