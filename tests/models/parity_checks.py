"""The parity checks every sliding-window model test runs against transformers in float32, written once:
prefill logits, token-by-token decode, and the engine in both KV layouts (packed must give per-layer's bits).
`case` is (transformers model, our model, checkpoint folder)."""

from __future__ import annotations

import torch

from hybridkv.engine.llm import LLM
from hybridkv.request.sampling_params import SamplingParams
from tests.models.util import assert_parity, hf_greedy, hf_logits, our_greedy, our_logits, prompt
from tests.recording import record_logits


def check_prefill(case, n: int, vocab: int) -> None:
    hf, model, _ = case
    ids = prompt(n, vocab)
    assert_parity(our_logits(model, ids), hf_logits(hf, ids))


def check_decode(case, n: int, vocab: int, steps: int) -> None:
    hf, model, _ = case
    theirs, their_logits = hf_greedy(hf, prompt(n, vocab), steps=steps)
    ours, our_step_logits = our_greedy(model, prompt(n, vocab), steps=steps)
    assert_parity(our_step_logits, their_logits)
    assert ours == theirs
    assert len(set(ours)) > 1


def run_engine(path, prompts: list[list[int]], layout: str, steps: int):
    llm = LLM(str(path), dtype="float32", kv_layout=layout, kv_cache_memory="16MiB", block_size=4)
    recorded = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0
    return outs, [torch.stack(recorded[out.request_id]) for out in outs]


def check_engine_layouts(case, vocab: int, window: int, steps: int) -> None:
    """A batch of prompts shorter and longer than the window: the logits at the prompt end and at every decode
    step within 1e-4 of transformers', greedy tokens equal; the packed layout gives the per-layer run's bits."""
    hf, _, path = case
    prompts = [prompt(n, vocab, seed=n).tolist() for n in (3, window + 1, 4 * window + 3)]
    runs = {layout: run_engine(path, prompts, layout, steps) for layout in ("per-layer", "packed")}
    outs, logits = runs["per-layer"]
    for p, out, ours in zip(prompts, outs, logits):
        theirs, their_logits = hf_greedy(hf, torch.tensor(p), steps=steps)
        assert_parity(ours, their_logits)
        assert list(out.outputs[0].token_ids) == theirs
    packed_outs, packed_logits = runs["packed"]
    assert [o.outputs[0].token_ids for o in packed_outs] == [o.outputs[0].token_ids for o in outs]
    assert all(torch.equal(a, b) for a, b in zip(packed_logits, logits))
