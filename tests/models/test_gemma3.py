"""Gemma 3 (`gemma3_text`) against transformers in float32: five sliding layers to one full, a window shorter
than the prompts, q/k norms, (1 + weight) norms, query_pre_attn_scalar, separate local and global RoPE bases
(the global one linearly scaled in one case), tied and untied heads, final logit softcapping; through the model
with the reference attention and through the engine, per-layer and packed.

With six layers every layer is a one-layer group and the two layouts coincide; the twelve-layer case (two full
layers, as in real Gemma 3s) packs two layers per group, so per-layer cuts each block in two and packed does not.
"""

import pytest
import torch

from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config
from hybridkv.models.gemma3 import rope_parameters_by_type
from hybridkv.models.linear import TiedLogits
from hybridkv.models.registry import build_model, load_model
from hybridkv.models.rope import inv_freq
from tests.models.parity_checks import check_decode, check_engine_layouts, check_prefill
from tests.models.util import randomize

transformers = pytest.importorskip("transformers")

WINDOW, VOCAB, STEPS = 8, 256, 16
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=WINDOW,
    max_position_embeddings=512,
)
S, F = "sliding_attention", "full_attention"
CASES = {
    # transformers' defaults: local base 1e4, global 1e6, query_pre_attn_scalar 256, tied head, 5:1 pattern.
    "default": {},
    "scaled": dict(
        num_hidden_layers=12,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
        final_logit_softcapping=30.0,
        layer_types=[S, F, S, S, S, S, S, S, F, S, S, S],
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(transformers model, our model, checkpoint folder) for one config."""
    path = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**(TINY | CASES[request.param])))
    return save_centred(hf, path), load_model(path, dtype="float32"), path


@torch.no_grad()
def save_centred(hf, path):
    """`save_random`, with each norm's weight then drawn around 0 rather than 1: Gemma scales by (1 + weight),
    so the norms scale around 1 as in the other models' tests. Around 2, twelve layers amplify float32 rounding
    to ~2e-4 (transformers' own float32 run against its float64 one), beyond the tolerance."""
    randomize(hf)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.sub_(1.0)
    hf.save_pretrained(path)
    hf.set_attn_implementation("eager")
    return hf.eval()


def test_layout_matches_transformers_and_the_kv_planner(case):
    hf, model, path = case
    types = hf.config.layer_types
    assert 5 * types.count(F) == types.count(S) == len(model.layers) * 5 // 6
    assert model.layer_windows == [WINDOW if t == S else None for t in types]
    assert model.kv_sharing == dict(model_kv_from_hf(load_hf_config(path)).shared) == {}
    tied = model.lm_head is None or isinstance(model.lm_head, TiedLogits)  # TiedLogits: a packed copy
    assert tied == hf.config.tie_word_embeddings


def test_rope_frequencies_match_transformers(case):
    hf, model, _ = case
    for t, rotary in model.rotary.items():
        theirs = getattr(hf.model.rotary_emb, f"{t}_inv_freq")
        assert torch.equal(rotary.freq, theirs), t
    assert not torch.equal(model.rotary["sliding_attention"].freq, model.rotary["full_attention"].freq)


@pytest.mark.parametrize("n", [WINDOW // 2, 3 * WINDOW + 5])
def test_prefill_logits_match(case, n):
    check_prefill(case, n, VOCAB)


@pytest.mark.parametrize("n", [5, 2 * WINDOW + 3])
def test_decode_matches_token_by_token(case, n):
    """Prompts shorter and longer than the window; the decode steps cross the window boundary either way."""
    check_decode(case, n, VOCAB, STEPS)


def test_engine_matches_transformers_in_both_layouts(case):
    check_engine_layouts(case, VOCAB, WINDOW, STEPS)


def test_the_layouts_differ_with_two_full_layers(case):
    """The packed comparison tests something only where the two layouts place the KV differently."""
    _, model, path = case
    config = load_hf_config(path)
    plans = {
        layout: plan_from_hf_config(config, CacheConfig(16 << 20, 256, kv_layout=layout), block_size=4, dtype="float32")
        for layout in ("per-layer", "packed")
    }
    assert len(plans["packed"].buffer_sizes) == 1
    assert (len(plans["per-layer"].buffer_sizes) > 1) == (len(model.layers) == 12)
    assert {g.kind for g in plans["packed"].groups} == {"full_attention", "sliding_window"}


def test_legacy_rope_fields_read_as_transformers_reads_them():
    """Hub configs written before transformers 5 carry rope_theta, rope_scaling and rope_local_base_freq."""
    legacy = dict(rope_theta=500_000.0, rope_local_base_freq=2_000.0, rope_scaling={"rope_type": "linear", "factor": 4})
    theirs = transformers.Gemma3TextConfig(**TINY, **legacy).rope_parameters
    ours = rope_parameters_by_type({**TINY, **legacy})
    for t in ("sliding_attention", "full_attention"):
        assert torch.equal(inv_freq(ours[t], 32), inv_freq(theirs[t], 32)), t
        assert ours[t]["rope_theta"] == theirs[t]["rope_theta"]
    assert ours["full_attention"]["factor"] == 4 and ours["sliding_attention"]["rope_type"] == "default"
    defaults = rope_parameters_by_type(TINY)
    assert (defaults["sliding_attention"]["rope_theta"], defaults["full_attention"]["rope_theta"]) == (1e4, 1e6)


def test_legacy_sliding_window_pattern():
    """Without layer_types, `sliding_window_pattern` places the full layers, as transformers places them."""
    cfg = transformers.Gemma3TextConfig(**(TINY | dict(num_hidden_layers=12)), sliding_window_pattern=4)
    legacy = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"} | {"sliding_window_pattern": 4}
    model = build_model(legacy, dtype="float32")
    assert model.layer_windows == [WINDOW if t == S else None for t in cfg.layer_types]
    assert model.layer_windows.count(None) == 3


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_unsupported_configs_are_refused(extra, match):
    cfg = transformers.Gemma3TextConfig(**TINY, **extra).to_dict()
    with pytest.raises(ValueError, match=match):
        build_model(cfg)


def test_a_config_without_head_dim_gets_transformers_defaults_in_model_and_plan():
    """transformers fills head_dim 256 and 4 KV heads, not hidden / heads: the model and the KV plan agree."""
    from hybridkv.kv.model_kv import MODEL_READERS

    cfg = transformers.Gemma3TextConfig(**TINY).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("head_dim", "num_key_value_heads")}
    model = build_model(cfg, dtype="float32")
    layers, _ = MODEL_READERS["gemma3_text"](cfg)
    want = transformers.Gemma3TextConfig(
        **{k: v for k, v in TINY.items() if k not in ("head_dim", "num_key_value_heads")}
    )
    assert {(a.num_kv_heads, a.head_size) for a in layers} == {(want.num_key_value_heads, want.head_dim)}
    assert model.layers[0].self_attn.head_dim == want.head_dim
