import pytest
import torch

from hybridkv.models.buffers import BufferCache

CPU = torch.device("cpu")


def test_a_buffer_is_reused_for_smaller_asks_and_grown_with_headroom_for_larger():
    cache = BufferCache(headroom=1.5)
    first = cache.get("k", (4, 8), torch.float32, CPU)
    again = cache.get("k", (2, 8), torch.float32, CPU)
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 8)
    assert cache.buffers["k"].numel() == 48  # 32 asked, 1.5x kept
    grown = cache.get("k", (7, 8), torch.float32, CPU)
    assert grown.shape == (7, 8) and cache.buffers["k"].numel() == 84
    assert cache.get("k", (8, 8), torch.float32, CPU).data_ptr() == grown.data_ptr()  # 64 <= 84: no regrowth
    assert cache.get("other", (1,), torch.float32, CPU).data_ptr() != grown.data_ptr()
    assert cache.get("k", (2, 8), torch.float64, CPU).dtype == torch.float64  # another dtype: a new buffer


def test_a_buffer_over_the_cap_is_handed_out_but_not_kept():
    cache = BufferCache(max_bytes=64)
    big = cache.get("k", (32,), torch.float32, CPU)  # 128 bytes
    assert big.shape == (32,) and "k" not in cache.buffers and cache.held_bytes() == 0
    cache.get("k", (16,), torch.float32, CPU)
    assert cache.held_bytes() == 64


def test_a_buffer_made_in_inference_mode_is_writable_outside_it():
    cache = BufferCache()
    with torch.inference_mode():
        cache.get("k", (4,), torch.float32, CPU).fill_(1.0)
    cache.get("k", (4,), torch.float32, CPU).fill_(2.0)  # an inference tensor would refuse this in-place write
    assert cache.buffers["k"].sum().item() == 8.0


@pytest.mark.parametrize("kwargs", [{"max_bytes": -1}, {"headroom": 0.5}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="max_bytes must be"):
        BufferCache(**kwargs)
