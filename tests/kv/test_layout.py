from pathlib import Path

import pytest
import torch

from hybridkv.kv.layout import cross_layers_enabled, parse_bool_option
from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.model_kv import ModelKV
from tests.kv.util import P, full, model, plan, sliding

ON = {"enable_cross_layers_blocks": "true"}


def gemma4_like() -> ModelKV:
    specs = [sliding(), sliding(), sliding(), full(head=32), sliding(), None, None, None]
    return ModelKV("test", tuple(specs), {5: 4, 6: 4, 7: 3})


def test_packed_is_off_by_default_for_multi_group_models():
    assert plan(model("FFSSSS"), 6 * P * 100).layout == "per_layer"


def test_cross_layers_option_packs_multi_group_models():
    default = plan(model("FFSSSS"), 6 * P * 100)
    p = plan(model("FFSSSS"), 6 * P * 100, enable_cross_layers_blocks=cross_layers_enabled(ON))
    assert p.layout == "packed" and len(p.buffer_sizes) == 1
    assert [(t.offset, t.block_stride, t.layers) for t in p.tensors] == [(0, 2 * P, (0, 2, 4)), (P, 2 * P, (1, 3, 5))]
    assert p.num_blocks == default.num_blocks and p.total_bytes == default.total_bytes
    assert all(0 <= t.offset < t.block_stride for t in p.tensors)
    assert [p.descriptors_per_block(g.group_id) for g in p.groups] == [1, 1, 1]
    assert [default.descriptors_per_block(g.group_id) for g in default.groups] == [2, 2, 2]


def test_single_group_keeps_per_layer_under_auto_even_with_the_option():
    p = plan(model("FFFF"), 4 * P * 100, enable_cross_layers_blocks=True)
    assert p.layout == "per_layer" and len(p.buffer_sizes) == 4


def test_packed_can_be_forced_for_a_dense_model():
    p = plan(model("FFFF"), 4 * P * 100, kv_layout="packed")
    assert p.layout == "packed" and len(p.buffer_sizes) == 1
    assert [(t.offset, t.layers) for t in p.tensors] == [(0, (0,)), (P, (1,)), (2 * P, (2,)), (3 * P, (3,))]
    assert p.descriptors_per_block(0) == 1


def test_per_layer_can_be_forced_on_a_multi_group_model_with_the_option():
    p = plan(model("FS"), 2 * P * 100, kv_layout="per-layer", enable_cross_layers_blocks=True)
    assert p.layout == "per_layer"


def test_uniform_type_with_differing_pages_is_always_packed():
    m = ModelKV("test", (full(), full(head=32), full()), {})
    p = plan(m, 4 * P * 100)
    assert len(p.groups) == 1 and p.layout == "packed"
    assert plan(m, 4 * P * 100, kv_layout="per-layer").layout == "per_layer"


@pytest.mark.parametrize("value", [True, "true", "TRUE", "True", " true "])
def test_option_accepts_true(value):
    assert cross_layers_enabled({"enable_cross_layers_blocks": value}) is True


@pytest.mark.parametrize("value", [False, "false", "FALSE", "False"])
def test_option_accepts_false(value):
    assert cross_layers_enabled({"enable_cross_layers_blocks": value}) is False


@pytest.mark.parametrize("value", ["yes", "1", 1, 0, None, "", "on", [True]])
def test_option_rejects_everything_else_naming_the_key(value):
    key = r"kv_connector_extra_config\.enable_cross_layers_blocks"
    with pytest.raises(ValueError, match=key + " must be true or false"):
        cross_layers_enabled({"enable_cross_layers_blocks": value})


def test_missing_option_means_off():
    assert cross_layers_enabled(None) is False and cross_layers_enabled({"other": 1}) is False
    assert parse_bool_option("false", "k") is False


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
@pytest.mark.parametrize("build", [lambda: model("FFSSSS"), gemma4_like, lambda: model("FFFSSSSSSS")])
def test_every_layer_view_owns_distinct_bytes(layout, build):
    """Write a distinct value through every (layer, block) view, then read all back: nothing overlaps, and a
    block id addresses the same bytes for every layer of its group in both layouts."""
    m = build()
    p = plan(m, 2 * P * 40, max_model_len=64, kv_layout=layout)
    mem = KVCacheMemory(p)
    assert mem.nbytes == p.total_bytes
    owner_of_block = {}
    for b in range(1, p.num_blocks):
        g = p.groups[b % len(p.groups)]  # each block id serves one group at a time
        owner_of_block[b] = g
        for layer in g.layers:
            mem.layer_view(layer)[b].fill_(float(1000 * layer + b))
    for b, g in owner_of_block.items():
        for layer in g.layers:
            assert torch.all(mem.layer_view(layer)[b] == float(1000 * layer + b)), (layer, b)
    used = sum(sum(g.pages) for g in owner_of_block.values())
    nonzero = sum(4 * int((buf.view(torch.float32) != 0).sum()) for buf in mem.buffers)
    assert nonzero == used  # every written element landed in its own place


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_consumers_alias_their_targets_view(layout):
    p = plan(gemma4_like(), 2 * P * 40, max_model_len=64, kv_layout=layout)
    mem = KVCacheMemory(p)
    assert mem.layer_view(5) is mem.layer_view(4) and mem.layer_view(7) is mem.layer_view(3)
    assert mem.layer_view(3).shape == (p.num_blocks, 16, 2, 2, 32)
    assert mem.layer_view(0).shape == (p.num_blocks, 16, 2, 2, 16)


def test_block_spans_match_the_views():
    for layout in ("per-layer", "packed"):
        p = plan(gemma4_like(), 2 * P * 40, max_model_len=64, kv_layout=layout)
        mem = KVCacheMemory(p)
        for g in p.groups:
            for layer in g.layers:
                mem.layer_view(layer)[7].fill_(1.0)
            spans = p.block_spans(g.group_id, 7)
            assert sum(n for _, _, n in spans) == g.used_bytes_per_block
            assert len(spans) == p.descriptors_per_block(g.group_id)
            covered = sum(4 * int((mem.buffers[buf][s : s + n].view(torch.float32) != 0).sum()) for buf, s, n in spans)
            assert covered == g.used_bytes_per_block
            for buf in mem.buffers:
                buf.zero_()
    packed = plan(gemma4_like(), 2 * P * 40, max_model_len=64, kv_layout="packed")
    assert [packed.block_spans(g.group_id, 7) for g in packed.groups] == [[(0, 7 * 2 * P, 2 * P)]] * 3


def resident_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_a_cpu_pool_is_zero_and_costs_memory_only_where_blocks_are_used(layout):
    """The pool's bytes read as zeros, but a 1 GiB budget is not made resident up front: the pages of the blocks
    written are (`memory.zeroed`). A pool built with torch.zeros or by writing every byte fails the first bound."""
    p = plan(model("FFSS"), 1 << 30, max_model_len=256, kv_layout=layout)
    before = resident_mib()
    mem = KVCacheMemory(p)
    assert resident_mib() - before < 64, "the whole budget became resident at start"
    view = mem.layer_view(0)
    assert int(view[1 : p.num_blocks : max(1, p.num_blocks // 64)].count_nonzero()) == 0
    view[:100].fill_(1.0)
    assert resident_mib() - before < 64 + 100 * p.groups[0].pages[0] * len(p.groups[0].layers) / 2**20
