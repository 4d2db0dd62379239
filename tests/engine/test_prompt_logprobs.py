"""Prompt logprobs (`engine/prompt_logprobs.py`): every prompt token after the first gets its logprob under the
model, as transformers computes it; a request that asks computes its whole prompt (no prefix hit, no loaded KV),
so asking twice gives the same values; chunked prefill gives the same values as one chunk."""

import pytest
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import DEFAULT_MODEL_DIR

TEXT = "Remember these codes. ant 58, bee 91, cow 7. Q: what is bee? A: bee 91. Q: what is ant? A: ant"


def prompt_logprobs(llm: LLM, ids: list[int], top: int = 2):
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top), use_tqdm=False)[0]
    return out.prompt_logprobs


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="8MiB", max_model_len=512)


def test_prompt_logprobs_equal_transformers(llm):
    transformers = pytest.importorskip("transformers")
    ids = llm.engine.tokenize(TEXT)
    ours = prompt_logprobs(llm, ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert ours[0] is None and len(ours) == len(ids)
    for p in range(1, len(ids)):
        assert ours[p].token_id == ids[p]
        assert abs(ours[p].logprob - ref[p - 1, ids[p]].item()) < 2e-4, p
        best = torch.topk(ref[p - 1], 2)
        assert [t for t, _ in ours[p].top] == best.indices.tolist(), p


def test_a_cached_prefix_is_computed_again_and_chunks_change_nothing(llm):
    ids = llm.engine.tokenize(TEXT * 3)  # > 64 tokens: a prefix hit would be possible
    first = prompt_logprobs(llm, ids)
    before = llm.engine.stats().prefix_hit_tokens
    assert prompt_logprobs(llm, ids) == first
    assert llm.engine.stats().prefix_hit_tokens == before  # it did not take the cached prefix
    chunked = LLM(kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=64)
    assert prompt_logprobs(chunked, ids) == first
