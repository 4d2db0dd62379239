import pytest

from hybridkv.kv.model_kv import ModelKV
from hybridkv.kv.planner import CacheConfig
from tests.kv.util import BS, P, full, model, plan, sliding


def groups(p):
    return [(g.kind, g.layers) for g in p.groups]


def tensors(p):
    return [(t.buffer, t.size, t.offset, t.block_stride, t.layers) for t in p.tensors]


def test_dense_two_full_layers():
    p = plan(model("FF"), 2 * P * 32)
    assert groups(p) == [("full_attention", (0, 1))]
    assert p.num_blocks == 32 and p.bytes_per_block == 2 * P
    assert p.layout == "per_layer"
    assert tensors(p) == [(0, P * 32, 0, P, (0,)), (1, P * 32, 0, P, (1,))]
    assert p.total_bytes == 2 * P * 32
    # 256 tokens = 16 blocks per request; 31 usable blocks.
    assert p.blocks_per_request == 16 and p.max_concurrency == pytest.approx(31 / 16)


def test_one_full_one_sliding_share_one_tensor_and_double_the_blocks():
    p = plan(model("FS"), 2 * P * 32)
    assert groups(p) == [("full_attention", (0,)), ("sliding_window", (1,))]
    assert p.num_blocks == 64 == 2 * plan(model("FF"), 2 * P * 32).num_blocks
    assert tensors(p) == [(0, P * 64, 0, P, (0, 1))]


def test_grouping_2f_4s():
    p = plan(model("FFSSSS"), 6 * P * 100)
    assert groups(p) == [("full_attention", (0, 1)), ("sliding_window", (2, 3)), ("sliding_window", (4, 5))]
    assert p.bytes_per_block == 2 * P and p.num_blocks == 300
    assert tensors(p) == [(0, P * 300, 0, P, (0, 2, 4)), (1, P * 300, 0, P, (1, 3, 5))]


def test_grouping_3f_7s_needs_no_padding():
    # Three full and seven sliding pages only split evenly one layer per group: no padded slot (vLLM pads
    # the sliding layers to 3 groups of 3 and wastes two pages per block id).
    p = plan(model("FFFSSSSSSS"), 10 * P * 100)
    assert [g.layers for g in p.groups] == [(i,) for i in range(10)]
    assert p.bytes_per_block == P and p.num_blocks == 1000
    assert tensors(p) == [(0, P * 1000, 0, P, tuple(range(10)))]


def test_grouping_6f_5s():
    p = plan(model("FFFFFFSSSSS"), 11 * P * 100)
    assert len(p.groups) == 11 and p.bytes_per_block == P and p.num_blocks == 1100


def test_grouping_prefers_fewer_groups_at_equal_cost():
    p = plan(model("FFFFSSSSSSSS"), 12 * P * 100)  # 4F + 8S: 4 pages per group, no padding anywhere
    assert groups(p) == [
        ("full_attention", (0, 1, 2, 3)),
        ("sliding_window", (4, 5, 6, 7)),
        ("sliding_window", (8, 9, 10, 11)),
    ]


def test_gemma4_like_two_head_sizes_and_kv_sharing():
    # S S S F S | S S F: full layers have head 32 (2P per page); layers 5, 6 read 4, layer 7 reads 3.
    specs = [sliding(), sliding(), sliding(), full(head=32), sliding(), None, None, None]
    m = ModelKV("test", tuple(specs), {5: 4, 6: 4, 7: 3})
    p = plan(m, 2 * P * 100)
    assert groups(p) == [("full_attention", (3,)), ("sliding_window", (0, 1)), ("sliding_window", (2, 4))]
    assert p.bytes_per_block == 2 * P and p.num_blocks == 100
    assert p.shared == {5: 4, 6: 4, 7: 3}
    assert p.tensor_of(5) is p.tensor_of(4) and p.tensor_of(7) is p.tensor_of(3)
    assert p.group_of(7) is p.group_of(3)
    assert all(c not in t.layers for t in p.tensors for c in (5, 6, 7))
    # Per-layer: the 2P full page is one region; the sliding pairs sit side by side inside it.
    assert tensors(p) == [(0, 2 * P * 100, 0, 2 * P, (3, 0, 2)), (0, 2 * P * 100, P, 2 * P, (1, 4))]
    assert p.kv_bytes_per_token == 4 * (P // BS) + 2 * P // BS
    # Without sharing the same budget holds fewer requests: consumers would own memory.
    unshared = ModelKV("test", (*specs[:5], sliding(), sliding(), full(head=32)), {})
    q = plan(unshared, 2 * P * 100)
    assert q.kv_bytes_per_token > p.kv_bytes_per_token
    assert p.max_concurrency > q.max_concurrency


def test_sliding_groups_budget_only_their_window():
    p = plan(model("FS"), 2 * P * 64, max_model_len=1024, max_num_batched_tokens=64)
    # full: 1024/16 = 64 blocks; sliding (window 32): cdiv(31, 16) + 1 = 3 blocks.
    assert p.blocks_per_request == 64 + 3
    assert p.blocks_admitted_per_request == 64 + (-(-(31 + 64) // 16) + 1)


def test_too_small_budget_names_the_largest_max_model_len():
    m = model("FS")
    with pytest.raises(ValueError, match=r"largest max_model_len that fits is (\d+)") as e:
        plan(m, 2 * P * 20, max_model_len=4096, max_num_batched_tokens=64)
    fits = int(e.value.args[0].split("fits is ")[1].split(".")[0])
    assert plan(m, 2 * P * 20, max_model_len=fits, max_num_batched_tokens=64).num_blocks == 40
    with pytest.raises(ValueError):
        plan(m, 2 * P * 20, max_model_len=fits + 1, max_num_batched_tokens=64)


def test_budget_below_one_block_is_an_error():
    with pytest.raises(ValueError, match="not even one block fits"):
        plan(model("FF"), P)


@pytest.mark.parametrize(
    "kw",
    [{"memory_bytes": 0}, {"max_model_len": 0}, {"max_num_batched_tokens": -1}, {"kv_layout": "interleaved"}],
)
def test_cache_config_rejects_bad_values(kw):
    args = {"memory_bytes": 1 << 20, "max_model_len": 128} | kw
    with pytest.raises(ValueError):
        CacheConfig(**args)


def test_mixed_block_sizes_are_rejected():
    m = ModelKV("test", (full(bs=16), sliding(bs=32)), {})
    with pytest.raises(ValueError, match="one block size"):
        plan(m, 1 << 20)


def test_block_size_16_sliding_window_is_never_rounded_up():
    # Full head 64 vs sliding head 16: pages differ 4x. Groups keep block size 16 and pack 4 sliding layers
    # per block id instead of scaling the sliding block to 64 tokens.
    m = ModelKV(
        "test", (sliding(window=16), sliding(window=16), sliding(window=16), sliding(window=16), full(head=64)), {}
    )
    p = plan(m, 4 * P * 50)
    assert [g.block_size for g in p.groups] == [16, 16]
    assert groups(p) == [("full_attention", (4,)), ("sliding_window", (0, 1, 2, 3))]
