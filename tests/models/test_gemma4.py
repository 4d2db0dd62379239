"""Gemma 4 against transformers in float32: sliding + full layers, KV sharing, PLE, proportional RoPE,
attention_k_eq_v, double-wide MLPs, and the multimodal checkpoint's text model."""

import pytest
import torch
import torch.nn.functional as F

from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.models.norm import norm_constants, scaled_rms_norm
from hybridkv.models.registry import build_model, load_model
from tests.models.util import (
    GEMMA4_TINY,
    assert_parity,
    hf_greedy,
    hf_logits,
    our_greedy,
    our_logits,
    prompt,
    save_random,
)

transformers = pytest.importorskip("transformers")

WINDOW = GEMMA4_TINY["sliding_window"]
CASES = {
    "kv_sharing": {},
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1, use_double_wide_mlp=True),
    "multimodal": {},
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(transformers model, our model, checkpoint folder) for one config."""
    path = tmp_path_factory.mktemp(request.param)
    text = transformers.Gemma4TextConfig(**GEMMA4_TINY, **CASES[request.param])
    if request.param == "multimodal":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
        config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)
        hf = transformers.Gemma4ForConditionalGeneration(config)
    else:
        hf = transformers.Gemma4ForCausalLM(text)
    hf = save_random(hf, path)
    return hf, load_model(path, dtype="float32"), path


def test_layout_matches_transformers_and_the_kv_planner(case):
    hf, model, path = case
    text = hf.config.get_text_config()
    assert model.layer_windows == [WINDOW if t == "sliding_attention" else None for t in text.layer_types]
    modes = text.kv_sharing_modes
    assert sorted(model.kv_sharing) == [i for i, m in enumerate(modes) if m == "reuse"]
    assert set(model.kv_sharing.values()) <= {i for i, m in enumerate(modes) if m == "store"}
    assert model.kv_sharing == dict(model_kv_from_hf(load_hf_config(path)).shared) == {5: 4, 6: 4, 7: 3}


@pytest.mark.parametrize("n", [WINDOW // 2, WINDOW, 3 * WINDOW + 5])
def test_prefill_logits_match(case, n):
    hf, model, _ = case
    ids = prompt(n)
    assert_parity(our_logits(model, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("n", [5, 2 * WINDOW + 3])
def test_decode_matches_token_by_token(case, n):
    """Prompts shorter and longer than the window; 20 decode steps cross the window boundary either way."""
    hf, model, _ = case
    theirs, their_logits = hf_greedy(hf, prompt(n), steps=20)
    ours, our_step_logits = our_greedy(model, prompt(n), steps=20)
    assert_parity(our_step_logits, their_logits)
    assert ours == theirs
    assert len(set(ours)) > 1


def test_k_eq_v_reuses_the_key_projection(case):
    hf, model, _ = case
    k_eq_v = hf.config.get_text_config().attention_k_eq_v
    full = model.layers[3].self_attn
    assert (full.v_proj is None) == k_eq_v and model.layers[0].self_attn.v_proj is not None
    if k_eq_v:
        assert full.k_proj.weight.shape == (32, 64)  # one global KV head of 32
        assert model.layers[5].mlp.gate_proj.weight.shape == (256, 64)  # double-wide on consumers


def test_consumers_have_no_kv_weights(case):
    _, model, _ = case
    for i in model.kv_sharing:
        assert model.layers[i].self_attn.k_proj is None
        assert not any(".k_" in n or ".v_" in n for n, _ in model.layers[i].named_parameters())


def test_moe_block_is_refused():
    cfg = transformers.Gemma4TextConfig(
        **GEMMA4_TINY, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
    )
    with pytest.raises(ValueError, match="enable_moe_block"):
        build_model(cfg.to_dict())


@pytest.mark.parametrize("dim", [16, 128])
def test_scaled_rms_norm_equals_rms_norm(dim):
    """The three-kernel float32 norm equals torch's rms_norm within rounding, zero rows included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, dim, generator=g) * torch.logspace(-4, 4, 7)[:, None, None]
    x[0, 0] = 0
    weight = torch.randn(dim, generator=g)
    ours = scaled_rms_norm(x, *norm_constants(dim, 1e-6, weight))
    ref = F.rms_norm(x, (dim,), weight, 1e-6)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0, 0], torch.zeros(dim))
    assert norm_constants(dim, 1e-6, weight.bfloat16()) is None  # half precision keeps the bit-exact rms_norm


def test_bound_attributes_follow_reassignment(case):
    """load_model copies submodules and parameters into each module's __dict__ for fast reads; assigning through
    setattr later still takes effect."""
    _, ours, _ = case
    layer = ours.layers[0]
    assert layer.__dict__["mlp"] is layer._modules["mlp"]
    new = torch.nn.Parameter(torch.zeros_like(layer.per_layer_projection.weight), requires_grad=False)
    old = layer.per_layer_projection.weight
    layer.per_layer_projection.weight = new
    try:
        assert layer.per_layer_projection.weight is new
    finally:
        layer.per_layer_projection.weight = old
