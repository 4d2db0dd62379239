"""Shared by the recurrent-hybrid tests: tiny random checkpoints, prompts around the split unit, and a greedy run
that records every sampled row of logits, to compare bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from hybridkv.engine.llm import LLM
from hybridkv.request.sampling_params import SamplingParams
from tests.recording import record_logits

HYBRIDS = ["qwen3_5", "nemotron_h"]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def build_hybrid(name: str, folder: Path) -> str:
    if name == "qwen3_5":
        from tests.models.tiny_qwen3_5 import build

        build(folder)
    else:
        from tests.models.tiny_nemotron_h import build_nemotron_h

        build_nemotron_h(folder)
    return str(folder)


def prompts(seed: int = 0) -> list[list[int]]:
    """Lengths around the split unit (32 or 64), and two prompts sharing 130 tokens with the first."""
    rng = random.Random(seed)
    base = [rng.randrange(4, 500) for _ in range(150)]
    tail = [rng.randrange(4, 500) for _ in range(90)]
    return [base, [rng.randrange(4, 500) for _ in range(40)], [7], base[:130] + tail[:70], base[:130] + tail]


def engine(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", "64MiB"), **kw)


def generate(llm: LLM, batch: list[list[int]]) -> list[torch.Tensor]:
    """Greedy outputs of `batch` submitted together; per request, its sampled logits rows stacked in step order."""
    run = llm.engine.runner.run
    rows = record_logits(llm)
    try:
        outs = llm.generate(batch, GREEDY)
    finally:
        llm.engine.runner.run = run
    llm.engine.kv.check_integrity()
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return [torch.stack(rows[o.request_id]) for o in outs]


def alone(model: str, batch: list[list[int]]) -> list[torch.Tensor]:
    """The reference: each prompt alone in a fresh engine, no prefix cache, one chunk per prompt."""
    return [generate(engine(model, enable_prefix_caching=False), [p])[0] for p in batch]


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"prompt {i}: logits differ by {(g - w).abs().max().item():.3g}"
