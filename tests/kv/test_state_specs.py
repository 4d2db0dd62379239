"""Recurrent-state specs from the shipped hybrid configs, against the sizes of shared/design/ssm-hybrids.md §2,
and the planner: the attention block size stays the user's, the state takes m pages of S bytes."""

import json
from pathlib import Path

import pytest
import torch

from hybridkv.kv.model_kv import load_hf_config, model_kv_from_hf
from hybridkv.kv.planner import CacheConfig, plan_from_hf_config, plan_kv_cache
from hybridkv.kv.spec import cdiv
from hybridkv.kv.state import RecurrentStateSpec

CONFIGS = Path(__file__).parents[2] / "examples" / "configs"
MiB = 1 << 20


def states(m):
    return [(i, s) for i, s in enumerate(m.specs) if isinstance(s, RecurrentStateSpec)]


def kv_per_token(m):
    return sum(s.bytes_per_token for s in m.specs if s is not None and not s.per_request_state)


# name, extra config fields, (state layers, attention layers, state bytes per layer, KV bytes per token, chunk)
SIZES = [
    ("qwen3.5-0.8b", {}, (18, 6, 1_085_440, 12_288, 64)),
    ("qwen3-next-80b-a3b", {}, (36, 12, 1_097_728, 24_576, 64)),
    ("qwen3-next-80b-a3b", {"mamba_ssm_dtype": "float32"}, (36, 12, 2_146_304, 24_576, 64)),
    ("nemotron-h-8b", {}, (24, 4, 2_158_592, 16_384, 128)),
    ("nemotron-h-8b", {"mamba_ssm_cache_dtype": "float32"}, (24, 4, 4_255_744, 16_384, 128)),
    ("granite-4.0-h-tiny", {}, (36, 4, 806_400, 8_192, 256)),
]


@pytest.mark.parametrize(("name", "extra", "want"), SIZES, ids=[f"{n}{'-fp32' if e else ''}" for n, e, _ in SIZES])
def test_state_sizes_match_the_design_note(name, extra, want):
    n_state, n_attn, per_layer, per_token, chunk = want
    m = model_kv_from_hf(load_hf_config(CONFIGS / f"{name}.json") | extra)
    st = states(m)
    assert len(st) == n_state and len(m.owners) - n_state == n_attn
    assert {s.state_bytes for _, s in st} == {per_layer}
    assert {s.chunk_size for _, s in st} == {chunk}
    assert kv_per_token(m) == per_token


def test_qwen35_shapes_and_dtypes():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "qwen3.5-0.8b.json"))
    s = states(m)[0][1]
    assert (s.mixer, s.conv_shape, s.ssm_shape) == ("gated_deltanet", (3, 6144), (16, 128, 128))
    assert (s.dtype, s.ssm_dtype) == (torch.bfloat16, torch.float32)  # conv: the KV dtype; state: the config's
    assert (s.conv_bytes, s.ssm_bytes) == (36_864, 1_048_576)
    assert [i for i, _ in states(m)] == [i for i in range(24) if (i + 1) % 4]
    assert 18 * s.state_bytes / MiB == pytest.approx(18.6, abs=0.05)


def test_nemotron_mlp_layers_keep_nothing_and_granite_reads_legacy_names():
    m = model_kv_from_hf(load_hf_config(CONFIGS / "nemotron-h-8b.json"))
    assert len(m.stateless) == 24 and all(m.specs[i] is None for i in m.stateless)
    s = states(m)[0][1]
    assert (s.mixer, s.conv_shape, s.ssm_shape, s.ssm_dtype) == ("mamba2", (3, 10240), (128, 64, 128), torch.bfloat16)
    g = states(model_kv_from_hf(load_hf_config(CONFIGS / "granite-4.0-h-tiny.json")))[0][1]
    assert (g.conv_shape, g.ssm_shape) == ((3, 3328), (48, 64, 128))


def test_bamba_and_layers_block_type_and_text_config_forms():
    bamba = {"model_type": "bamba", "num_hidden_layers": 4, "attn_layer_indices": [2], "hidden_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 4, "mamba_d_head": "auto",
             "mamba_expand": 2, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4}  # fmt: skip
    m = model_kv_from_hf(bamba, dtype="float32")
    assert [s.kind for s in m.specs] == ["recurrent_state"] * 2 + ["full_attention", "recurrent_state"]
    assert m.specs[0].ssm_shape == (4, 32, 8) and m.specs[0].chunk_size == 256
    nemo = json.loads((CONFIGS / "nemotron-h-8b.json").read_text())
    pattern = nemo.pop("hybrid_override_pattern")
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    listed = model_kv_from_hf(nemo | {"layers_block_type": [names[c] for c in pattern]})
    assert listed == model_kv_from_hf(load_hf_config(CONFIGS / "nemotron-h-8b.json"))
    text = load_hf_config(CONFIGS / "qwen3.5-0.8b.json")["text_config"]
    assert model_kv_from_hf(text).specs == model_kv_from_hf(load_hf_config(CONFIGS / "qwen3.5-0.8b.json")).specs


@pytest.mark.parametrize(
    ("name", "drop", "field"),
    [("qwen3.5-0.8b", "linear_num_value_heads", "linear_num_value_heads"),
     ("nemotron-h-8b", "ssm_state_size", "ssm_state_size"),
     ("granite-4.0-h-tiny", "mamba_n_heads", "mamba_n_heads")],
)  # fmt: skip
def test_a_missing_field_is_named(name, drop, field):
    cfg = load_hf_config(CONFIGS / f"{name}.json")
    inner = cfg.get("text_config", cfg)
    del inner[drop]
    with pytest.raises(ValueError, match=f"lacks the field '{field}'"):
        model_kv_from_hf(cfg)


def test_bad_pattern_and_counts_are_clear_errors():
    cfg = load_hf_config(CONFIGS / "nemotron-h-8b.json")
    with pytest.raises(ValueError, match="unknown letters"):
        model_kv_from_hf(cfg | {"hybrid_override_pattern": "M*X"})
    with pytest.raises(ValueError, match="num_hidden_layers is 52"):
        model_kv_from_hf(cfg | {"hybrid_override_pattern": "M*"})


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3-next-80b-a3b", "nemotron-h-8b", "granite-4.0-h-tiny"])
def test_plan_keeps_the_block_size_and_cuts_the_state_into_pages(name):
    hf = load_hf_config(CONFIGS / f"{name}.json")
    cfg = CacheConfig(memory_bytes=16 << 30, max_model_len=8192)
    p = plan_from_hf_config(hf, cfg, block_size=16)
    m = model_kv_from_hf(hf, block_size=16)
    assert {g.block_size for g in p.groups} == {16}  # no coarsening to fit a state
    st = p.state
    blob = sum(s.state_bytes for _, s in states(m))
    assert st.blob_bytes == blob and st.page_bytes == p.bytes_per_block
    assert st.num_pages == cdiv(blob, p.bytes_per_block) == p.groups[st.group].pages_per_entry
    assert st.padding_bytes == st.num_pages * p.bytes_per_block - blob < p.bytes_per_block
    assert st.group == len(p.groups) - 1  # one state group, after the attention groups
    assert st.layers == tuple(i for i, _ in states(m))
    assert sorted(p.attention_layers + st.layers + tuple(m.stateless)) == list(range(m.num_layers))
    attention = [g for g in p.groups if not g.is_state]
    assert p.bytes_per_block == max(g.used_bytes_per_block for g in attention)  # S from the attention layers
    held = sum(g.spec.blocks_held(8192) for g in attention)
    assert p.blocks_per_request == held + st.num_pages  # one live state: m pages
    assert p.blocks_admitted_per_request == held + 2 * st.num_pages  # old and new live state in a crossing step
    reserve = st.num_pages
    assert p.max_concurrency == pytest.approx((p.num_blocks - 1 - reserve) / (held + st.num_pages))
    assert st.align == {"qwen3.5-0.8b": 64, "qwen3-next-80b-a3b": 64, "nemotron-h-8b": 128}.get(name, 256)
    d = p.to_dict()["state"]
    assert d["num_pages"] == st.num_pages and d["group"] == st.group


def test_plan_counts_the_state_pages_at_every_block_bytes_candidate():
    """With S = one page (4 groups) or four pages (1 group) the attention bytes tie; the state's padding decides."""
    hf = load_hf_config(CONFIGS / "nemotron-h-8b.json")
    p = plan_from_hf_config(hf, CacheConfig(memory_bytes=16 << 30, max_model_len=8192))
    # Attention pages are 65,536 B; 4 per group would give S = 262,144 and 198 pages (pad 96 KiB): more bytes.
    assert p.bytes_per_block == 65_536 and p.state.num_pages == 791 and p.state.padding_bytes == 32_768


def test_a_model_of_recurrent_layers_only_gets_one_page_of_the_whole_state():
    spec = RecurrentStateSpec(dtype=torch.float32, block_size=16, mixer="mamba2", conv_shape=(3, 40),
                              ssm_shape=(2, 4, 8), ssm_dtype=torch.float32, chunk_size=32)  # fmt: skip
    from hybridkv.kv.model_kv import ModelKV

    p = plan_kv_cache(ModelKV("ssm", (spec, spec)), CacheConfig(memory_bytes=1 << 20, max_model_len=64))
    assert p.bytes_per_block == p.state.blob_bytes == 2 * (512 + 256) and p.state.num_pages == 1
    assert p.buffer_sizes == (p.bytes_per_block * p.num_blocks,) and p.attention_layers == ()
    assert p.state.align == 32
