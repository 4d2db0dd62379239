"""Engine vs transformers in float32: logits of prefill and every decode step within 1e-4, greedy tokens equal,
across layouts, batches of mixed lengths (shorter and longer than the window), prefix hits, chunked prefill and
preemption. After every run the block pool is intact and empty."""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config
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


def record_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row of logits is kept, per request, in step order."""
    recorded: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.runner.run

    def recording_run(output):
        ids, logits = run(output)
        for rid, row in zip(ids, logits):
            recorded.setdefault(rid, []).append(row.clone())
        return ids, logits

    llm.engine.runner.run = recording_run
    return recorded


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
