import json
from pathlib import Path

import pytest
import torch

from hybridkv.kv.model_kv import gemma4_kv_targets, load_hf_config, model_kv_from_hf
from hybridkv.kv.spec import FullAttentionSpec, SlidingWindowSpec

CONFIGS = Path(__file__).parents[2] / "examples" / "configs"
S, F = "sliding_attention", "full_attention"


def kinds(m):
    return "".join("-" if s is None else s.kind[0].upper() for s in m.specs)


def test_llama_is_dense_full_attention():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "llama-3-8b.json"))
    assert kinds(m) == "F" * 32 and m.shared == {}
    spec = m.specs[0]
    assert isinstance(spec, FullAttentionSpec)
    assert (spec.num_kv_heads, spec.head_size, spec.dtype) == (8, 128, torch.bfloat16)
    assert spec.page_size_bytes == 16 * 2 * 8 * 128 * 2


def test_qwen3_uses_its_head_dim():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "qwen3-0.6b.json"), dtype="float32", block_size=32)
    assert kinds(m) == "F" * 28 and m.specs[0].head_size == 128 and m.specs[0].block_size == 32


def test_mistral_with_a_window_slides_every_layer():
    cfg = load_hf_config(CONFIGS / "llama-3-8b.json") | {"model_type": "mistral", "sliding_window": 4096}
    assert kinds(model_kv_from_hf(cfg)) == "S" * 32
    assert kinds(model_kv_from_hf(cfg | {"sliding_window": None})) == "F" * 32


def test_gemma3_derives_the_pattern_without_layer_types():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "gemma3-27b-like.json"))
    assert kinds(m) == ("SSSSSF" * 11)[:62]
    assert isinstance(m.specs[0], SlidingWindowSpec) and m.specs[0].sliding_window == 1024


def test_gpt_oss_alternates():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "gpt-oss-20b-like.json"))
    assert kinds(m) == "SF" * 12 and m.specs[0].sliding_window == 128 and m.specs[0].head_size == 64


def test_gemma4_old_format_without_kv_sharing_modes():
    cfg = load_hf_config(CONFIGS / "gemma4-e2b-like.json")
    assert "kv_sharing_modes" not in cfg and "per_layer_config" not in cfg
    m = model_kv_from_hf(cfg)
    assert kinds(m) == "SSSSFSSSSFSSSSF" + "-" * 20
    assert m.specs[4].head_size == 512 and m.specs[0].head_size == 256
    assert m.specs[4].num_kv_heads == 1
    assert set(m.shared) == set(range(15, 35))
    assert all(m.shared[i] == (14 if (i + 1) % 5 == 0 else 13) for i in m.shared)


def test_gemma4_multimodal_reads_its_text_config():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "gemma4-e4b-like-multimodal.json"))
    assert m.num_layers == 42 and len(m.shared) == 18 and m.owners == list(range(24))


def test_gemma4_global_kv_heads_apply_only_with_k_eq_v():
    cfg = load_hf_config(CONFIGS / "gemma4-31b-like.json")
    assert model_kv_from_hf(cfg).specs[5].num_kv_heads == 4
    assert model_kv_from_hf(cfg | {"attention_k_eq_v": False}).specs[5].num_kv_heads == 16
    absent = {k: v for k, v in cfg.items() if k != "attention_k_eq_v"}  # transformers defaults it to false
    assert model_kv_from_hf(absent).specs[5].num_kv_heads == 16


@pytest.mark.parametrize(
    ("types", "shared"),
    [
        ([S, S, S, F, S, S, S, F], 3),
        ([S, S, S, S, F] * 7, 20),
        ([S, F] * 6, 4),
        ([S, S, S, F, S, S, S, F], 0),
        ([S, S, F, S, S, F, S, F, S, S, S, F], 7),
    ],
)
def test_gemma4_sharing_matches_transformers(types, shared):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma4TextConfig(
        num_hidden_layers=len(types),
        layer_types=types,
        num_kv_shared_layers=shared,
        head_dim=16,
        global_head_dim=32,
        num_key_value_heads=2,
        num_attention_heads=4,
        hidden_size=64,
    )
    modes = hf.kv_sharing_modes
    ours = gemma4_kv_targets(types, shared)
    assert sorted(ours) == [i for i, mode in enumerate(modes) if mode == "reuse"]
    for consumer, target in ours.items():
        assert modes[target] == "store" and types[target] == types[consumer]
    # The per-layer head sizes transformers computes, read back from the dict it saves.
    m = model_kv_from_hf(hf.to_dict())
    for i, spec in enumerate(m.specs):
        if spec is not None:
            layer = hf.per_layer_config[i]
            assert (spec.head_size, spec.num_kv_heads) == (layer.head_dim, layer.num_key_value_heads)


def test_tiny_gemma4_written_by_transformers_5_24():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "gemma4-tiny.json"), dtype="float32")
    assert m.shared == {5: 4, 6: 4, 7: 3}
    assert (m.specs[3].head_size, m.specs[3].num_kv_heads) == (32, 1)
    assert (m.specs[0].head_size, m.specs[0].num_kv_heads) == (16, 2)


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported model_type 'mamba'; supported: .*gemma4_text.*llama"):
        model_kv_from_hf({"model_type": "mamba"})


def test_missing_fields_and_bad_layer_types_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks the field 'num_hidden_layers'"):
        model_kv_from_hf({"model_type": "llama"})
    cfg = load_hf_config(CONFIGS / "gpt-oss-20b-like.json")
    with pytest.raises(ValueError, match="unsupported type 'chunked_attention'"):
        model_kv_from_hf(cfg | {"layer_types": ["chunked_attention"] * 24})
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        model_kv_from_hf(json.loads((CONFIGS / "llama-3-8b.json").read_text()), dtype="int3")
