"""read_pages / write_pages: a state page is all S bytes of a block id, in offset order, in both layouts."""

import pytest
import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.model_kv import ModelKV
from tests.kv.test_state_manager import state
from tests.kv.util import P, full, plan


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_pages_round_trip_and_alias_the_attention_pages(layout):
    m = ModelKV("test", (full(), full(), state(), state()), {})
    p = plan(m, 2 * P * 10, max_model_len=32, kv_layout=layout)
    assert p.bytes_per_block == 2 * P and p.state.num_pages == 1
    assert len(p.buffer_sizes) == (2 if layout == "per-layer" else 1)
    assert p.total_bytes == p.bytes_per_block * p.num_blocks
    mem = KVCacheMemory(p)
    assert set(mem.views) == {0, 1}  # no attention view for a recurrent layer
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3, p.bytes_per_block), dtype=torch.uint8, generator=g)
    ids = torch.tensor([7, 2, 5])
    mem.write_pages(ids, data)
    assert torch.equal(mem.read_pages(ids), data)
    assert torch.equal(mem.read_pages(torch.tensor([5])), data[2:])
    assert mem.read_pages(torch.tensor([1, 3])).count_nonzero() == 0  # other blocks untouched
    # Offset order: layer 1's page of block 2 is bytes [P, 2P) of the block, whatever the layout.
    layer1 = mem.layer_view(1)[2].contiguous().view(torch.uint8).flatten()
    assert torch.equal(layer1, data[1, P:])
    spans = p.block_spans(p.state.group, 2)
    assert sum(length for _, _, length in spans) == p.bytes_per_block
    assert p.descriptors_per_block(p.state.group) == len(p.buffer_sizes)


def test_write_pages_refuses_a_wrong_shape():
    p = plan(ModelKV("test", (full(), state()), {}), P * 10, max_model_len=32)
    mem = KVCacheMemory(p)
    with pytest.raises(ValueError, match="uint8"):
        mem.write_pages(torch.tensor([1]), torch.zeros(1, P - 1, dtype=torch.uint8))


def test_a_page_spans_regions_of_different_widths():
    # Head 32 (2P pages) and head 16 (P) full layers in one group of S = 3P: regions [0, 2P) and [2P, 3P).
    m = ModelKV("test", (full(head=32), full(), state()), {})
    p = plan(m, 2 * P * 10, kv_layout="per-layer", max_model_len=32)
    assert p.page_regions() == [(0, 2 * P), (1, P)]
    assert p.total_bytes == p.bytes_per_block * p.num_blocks
    mem = KVCacheMemory(p)
    data = torch.arange(p.bytes_per_block, dtype=torch.int64).remainder(251).to(torch.uint8)[None]
    mem.write_pages(torch.tensor([3]), data)
    assert torch.equal(mem.read_pages(torch.tensor([3])), data)
    assert torch.equal(mem.layer_view(1)[3].contiguous().view(torch.uint8).flatten(), data[0, 2 * P :])


def test_a_recurrent_only_plan_allocates_its_one_region_per_layer():
    p = plan(ModelKV("ssm", (state(), state())), 1 << 16, max_model_len=32, kv_layout="per-layer")
    mem = KVCacheMemory(p)
    assert mem.views == {} and p.page_regions() == [(0, p.bytes_per_block)]
    data = torch.full((2, p.bytes_per_block), 7, dtype=torch.uint8)
    mem.write_pages(torch.tensor([1, 2]), data)
    assert torch.equal(mem.read_pages(torch.tensor([2, 1])), data)
