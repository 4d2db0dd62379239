"""GPT-OSS (`gpt_oss`) against transformers in float32: alternating sliding (window 8) and full layers, biased
q/k/v/o, learned attention sinks, top-2 of 4 experts with a clamped SwiGLU, yarn RoPE with its attention factor;
through the model with the reference attention and through the engine, per-layer and packed.
"""

import pytest
import torch

from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config
from hybridkv.models.registry import build_model, load_model
from hybridkv.models.rope import attention_factor, inv_freq, rope_parameters
from tests.models.parity_checks import check_decode, check_engine_layouts, check_prefill
from tests.models.util import hf_logits, prompt, randomize

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

WINDOW, VOCAB, STEPS, HEAD_DIM, LIMIT = 8, 256, 16, 16, 1.0
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, original_max_position_embeddings=64)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    swiglu_limit=LIMIT,  # low enough that the clamps act on these weights
    rope_parameters=YARN,
)
S, F = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(transformers model, our model, checkpoint folder)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY))
    randomize(hf)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in sorted(hf.named_parameters()):
            if name.endswith("bias"):  # around 0: biases around 1 would route every token to the same experts
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("sinks"):  # either side of 0, large enough to take a visible share of a softmax
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    hf.save_pretrained(path)
    hf.set_attn_implementation("eager")
    return hf.eval(), load_model(path, dtype="float32"), path


def test_layout_matches_transformers_and_the_kv_planner(case):
    hf, model, path = case
    assert hf.config.layer_types == [S, F, S, F]
    assert model.layer_windows == [WINDOW, None, WINDOW, None]
    assert model.kv_sharing == dict(model_kv_from_hf(load_hf_config(path)).shared) == {}
    assert all(layer.self_attn.sinks.abs().min() > 0 for layer in model.layers)


def test_rope_frequencies_and_attention_factor_match_transformers(case):
    hf, model, _ = case
    assert torch.equal(model.rotary.freq, hf.model.rotary_emb.inv_freq)
    assert model.rotary.scale == hf.model.rotary_emb.attention_scaling != 1.0


YARN_CASES = {
    "test": {},
    "truncate_false": dict(truncate=False, beta_fast=16.0, beta_slow=2.0),
    "explicit_attention_factor": dict(attention_factor=1.25),
    "mscale": dict(factor=8.0, mscale=0.7, mscale_all_dim=1.0),
    "factor_from_lengths": dict(factor=None),
    "gpt_oss_default": None,  # no rope_parameters: GptOssConfig's yarn, theta 150000
}


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_matches_transformers(name):
    extra = YARN_CASES[name]
    fields = {k: v for k, v in TINY.items() if k != "rope_parameters"}
    if extra is not None:
        fields["rope_parameters"] = YARN | extra
    config = transformers.GptOssConfig(**fields)
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    if extra is None:
        rotary = build_model({"model_type": "gpt_oss", **fields}, dtype="float32").rotary
        ours, our_factor = rotary.freq, rotary.scale
    else:
        params = rope_parameters(config.to_dict())
        ours, our_factor = inv_freq(params, HEAD_DIM), attention_factor(params)
    assert torch.equal(ours, theirs)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)
    assert not torch.equal(
        ours, inv_freq({"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}, HEAD_DIM)
    )


def test_legacy_rope_scaling_reads_as_transformers_reads_it():
    """The hub checkpoints' config.json carries `rope_scaling` and a top-level `rope_theta`."""
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"} | {"truncate": False}
    legacy = dict(rope_theta=150_000.0, rope_scaling=scaling)
    fields = {k: v for k, v in TINY.items() if k != "rope_parameters"} | legacy
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(**fields))
    rotary = build_model({"model_type": "gpt_oss", **fields}, dtype="float32").rotary
    assert torch.equal(rotary.freq, theirs) and rotary.scale == their_factor


@pytest.mark.parametrize("n", [WINDOW // 2, 3 * WINDOW + 5])
def test_prefill_logits_match(case, n):
    check_prefill(case, n, VOCAB)


@pytest.mark.parametrize("n", [5, 2 * WINDOW + 3])
def test_decode_matches_token_by_token(case, n):
    """Prompts shorter and longer than the window; the decode steps cross the window boundary either way."""
    check_decode(case, n, VOCAB, STEPS)


def test_engine_matches_transformers_in_both_layouts(case):
    check_engine_layouts(case, VOCAB, WINDOW, STEPS)


def test_the_layouts_differ(case):
    """The packed comparison tests something only where the two layouts place the KV differently: two sliding
    and two full layers make two one-buffer groups per-layer, one shared buffer packed."""
    _, _, path = case
    config = load_hf_config(path)
    plans = {
        layout: plan_from_hf_config(config, CacheConfig(16 << 20, 256, kv_layout=layout), block_size=4, dtype="float32")
        for layout in ("per-layer", "packed")
    }
    assert (len(plans["per-layer"].buffer_sizes), len(plans["packed"].buffer_sizes)) == (2, 1)
    assert {g.kind for g in plans["packed"].groups} == {"full_attention", "sliding_window"}


@torch.no_grad()
def test_the_swiglu_clamps_and_routing_are_exercised(case):
    """The comparison tests the clamps only if some gate/up values pass the limit, and the routing only if
    tokens pick different experts."""
    hf, _, _ = case
    seen = []

    def grab(module, args):
        x, chosen, _ = args
        gate_up = torch.einsum("nh,ehi->eni", x, module.gate_up_proj) + module.gate_up_proj_bias[:, None]
        seen.append((gate_up, chosen))

    hooks = [layer.mlp.experts.register_forward_pre_hook(grab) for layer in hf.model.layers]
    hf_logits(hf, prompt(3 * WINDOW, VOCAB))
    for h in hooks:
        h.remove()
    assert any((g[..., 0::2] > LIMIT).any() for g, _ in seen)
    assert any((g[..., 1::2].abs() > LIMIT).any() for g, _ in seen)
    assert all(len(chosen.unique()) == TINY["num_local_experts"] for _, chosen in seen)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(rope_parameters=YARN | dict(partial_rotary_factor=0.5)), "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused(extra, match):
    cfg = {"model_type": "gpt_oss", **TINY, **extra}
    with pytest.raises(ValueError, match=match):
        build_model(cfg)
