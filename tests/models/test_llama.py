"""Dense models against transformers in float32: llama (plain and llama3 RoPE scaling), qwen2 (q/k/v biases),
qwen3 (q/k norms, sliding upper layers, untied head) and mistral (with and without a window on every layer)."""

import pytest

from hybridkv.models.registry import load_model
from tests.models.util import assert_parity, hf_greedy, hf_logits, our_greedy, our_logits, prompt, save_random
from tests.tiny_models import DENSE_TINY

transformers = pytest.importorskip("transformers")

TINY = DENSE_TINY | {"max_position_embeddings": 256}
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500_000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE, attention_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    config_cls, model_cls, extra = CASES[request.param]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(getattr(transformers, model_cls)(config), path)
    return request.param, hf, load_model(path, dtype="float32")


@pytest.mark.parametrize("n", [6, 40])
def test_prefill_logits_match(case, n):
    _, hf, model = case
    ids = prompt(n)
    assert_parity(our_logits(model, ids), hf_logits(hf, ids))


def test_decode_matches_token_by_token(case):
    _, hf, model = case
    theirs, their_logits = hf_greedy(hf, prompt(12), steps=16)
    ours, our_step_logits = our_greedy(model, prompt(12), steps=16)
    assert_parity(our_step_logits, their_logits)
    assert ours == theirs


def test_windows(case):
    name, _, model = case
    assert model.kv_sharing == {}
    expected = {"qwen3": [None, None, 8, 8], "mistral_sliding": [8] * 4}
    assert model.layer_windows == expected.get(name, [None] * 4)
