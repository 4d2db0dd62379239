"""The native in-pool state step (`runner/kernels/state_step.cpp`) against the torch step it must equal bit for bit
(`gated_delta_step`, `causal_conv1d`), on blobs scattered over pages and regions the way the block pool holds them:
heads that straddle a page or region end, a destination other than the source (copy-on-write at a block end), the
source left as it was, bytes outside the slot untouched, and any batch or thread count giving a request its bits."""

from __future__ import annotations

import pytest
import torch

from hybridkv.models import gated_deltanet as gdn
from hybridkv.models.state_store import dequantize_rows, quantize_rows
from hybridkv.runner import kernels
from hybridkv.runner.states import STORAGE_CODES, _addresses


@pytest.fixture(scope="module")
def kernel():
    module = kernels.state_step()
    assert module is not None, "the native state-step kernel did not build (see the log)"
    return module


class Pool:
    """Block ids of S = sum(widths) bytes, each cut into regions (one buffer per region, as the per-layer layout
    does; one region is the packed layout). Blob page j = all regions of block id pages[j], in order."""

    def __init__(self, widths: list[int], num_blocks: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.widths = torch.tensor(widths, dtype=torch.int64)
        self.buffers = [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=g) for w in widths]

    def addresses(self, entries: list[list[int]]) -> torch.Tensor:
        bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        return _addresses(bases, self.widths, torch.tensor(entries))

    def starts(self, m: int) -> torch.Tensor:
        return torch.cat((torch.zeros(1, dtype=torch.int64), self.widths.repeat(m).cumsum(0)))

    def blob(self, pages: list[int]) -> torch.Tensor:
        return torch.cat([b[p] for p in pages for b in self.buffers])

    def write(self, pages: list[int], blob: torch.Tensor) -> None:
        at = 0
        for p in pages:
            for b in self.buffers:
                b[p] = blob[at : at + b.shape[1]]
                at += b.shape[1]


def _entries(n: int, m: int, num_blocks: int, seed: int) -> list[list[int]]:
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: n * m].tolist()
    return [ids[r * m : (r + 1) * m] for r in range(n)]


def _state_bytes(state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 state [H, dk, dv] as its stored bytes: float32 or bfloat16 values, or int8 rows then (64-byte
    aligned) their float32 scales (`models/state_store`)."""
    if dtype != torch.int8:
        return state.to(dtype).reshape(-1).view(torch.uint8)
    codes, scales = quantize_rows(state)
    pad = torch.zeros(-codes.numel() % 64, dtype=torch.uint8)
    return torch.cat((codes.reshape(-1).view(torch.uint8), pad, scales.reshape(-1).view(torch.uint8)))


def _stored_state(blob: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The float32 state a blob holds at `offset` (`_state_bytes` read back)."""
    n = shape[0] * shape[1] * shape[2]
    if dtype != torch.int8:
        return blob[offset : offset + n * dtype.itemsize].view(dtype).view(shape).float()
    codes = blob[offset : offset + n].view(torch.int8).view(shape)
    scales_at = offset + n + (-n % 64)
    return dequantize_rows(codes, blob[scales_at : scales_at + n // shape[2] * 4].view(torch.float32).view(shape[:2]))


def _state_blob(pool: Pool, pages: list[int], offset: int, shape: tuple[int, ...], seed: int, dtype=torch.float32):
    """Put a well-scaled state at `offset` of the blob (random bytes would hold NaNs)."""
    blob = pool.blob(pages)
    values = _state_bytes(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1, dtype)
    blob[offset : offset + values.numel()] = values
    pool.write(pages, blob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    ("widths", "copy_on_write", "aligned"),
    [([4096], False, False), ([4096], True, False), ([1000, 3096], True, False), ([4096], False, True),
     ([4096], True, True)],
)  # fmt: skip
def test_delta_step_equals_the_torch_step_on_scattered_pages(kernel, widths, copy_on_write, aligned, dtype):
    n, heads, dk, dv = 5, 3, 16, 24  # one head = 1536 bytes in float32: heads straddle page and region ends
    offset = 2000  # the slot starts inside page 0 (or its second region)
    if aligned:  # float32 rows of 128 bytes on 64-byte boundaries, never across a page end: read where they lie
        dv, offset = 32, 2048  # and streamed out (non-temporal stores)
    size = _state_bytes(torch.zeros(heads, dk, dv), dtype).numel()
    m = -(-(offset + size) // sum(widths))
    pool = Pool(widths, num_blocks=64, seed=0)
    entries = _entries(2 * n, m, 64, seed=1)
    src = entries[:n]
    dst = entries[n:] if copy_on_write else src
    for r, pages in enumerate(src):
        _state_blob(pool, pages, offset, (heads, dk, dv), seed=10 + r, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g)
    decay, beta = torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    before = [pool.blob(p).clone() for p in src]
    dst_before = [pool.blob(p).clone() for p in dst]
    state = torch.stack([_stored_state(b, offset, (heads, dk, dv), dtype) for b in before])
    want_out, want_state = gdn.gated_delta_step(q, k, v, decay, beta, state)

    a, b, starts = pool.addresses(src), pool.addresses(dst), pool.starts(m)
    out = kernel.delta_step(q, k, v, decay, beta, a, b, starts, offset, STORAGE_CODES[dtype])

    assert torch.equal(out, want_out)
    for r in range(n):
        after = pool.blob(dst[r])
        assert torch.equal(after[offset : offset + size], _state_bytes(want_state[r], dtype))
        outside = torch.ones(after.numel(), dtype=torch.bool)
        outside[offset : offset + size] = False
        assert torch.equal(after[outside], dst_before[r][outside]), "bytes outside the slot changed"
        if copy_on_write:
            assert torch.equal(pool.blob(src[r]), before[r]), "the source entry (a checkpoint) was written"


def test_delta_step_bits_do_not_depend_on_the_batch_or_threads(kernel):
    n, heads, dk, dv, m = 6, 4, 32, 32, 2
    pool = Pool([8192], num_blocks=32, seed=3)
    entries = _entries(n, m, 32, seed=4)
    for r, pages in enumerate(entries):
        _state_blob(pool, pages, 0, (heads, dk, dv), seed=20 + r)
    saved = [b.clone() for b in pool.buffers]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, heads, d, generator=g) for d in (dk, dk, dv))
    decay, beta = torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)

    def run(rows: list[int], threads: int) -> torch.Tensor:
        for b, s in zip(pool.buffers, saved, strict=True):
            b.copy_(s)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            a = pool.addresses([entries[r] for r in rows])
            i = torch.tensor(rows)
            return kernel.delta_step(q[i], k[i], v[i], decay[i], beta[i], a, a, pool.starts(m), 0, 0)
        finally:
            torch.set_num_threads(old)

    whole = run(list(range(n)), 2)
    for r in range(n):
        assert torch.equal(run([r], 1)[0], whole[r])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["scattered", "rows_in_one_page", "rows_in_one_page_in_place"])
def test_conv_step_equals_causal_conv1d(kernel, x_dtype, window_dtype, layout):
    """Rows across page and region ends (gathered and scattered), and rows that lie in one page (read and moved
    where they lie; in place, each row must be read before it is overwritten)."""
    n, taps_n, dim, offset = 4, 4, 300, 700
    widths = [512, 256] if layout == "scattered" else [8192]
    esize = torch.finfo(window_dtype).bits // 8
    window_bytes = (taps_n - 1) * dim * esize
    pool = Pool(widths, num_blocks=64, seed=6)
    m = -(-(offset + window_bytes) // sum(widths))
    entries = _entries(2 * n, m, 64, seed=7)
    src, dst = entries[:n], entries[:n] if layout.endswith("in_place") else entries[n:]
    g = torch.Generator().manual_seed(8)
    windows = torch.randn(n, taps_n - 1, dim, generator=g).to(window_dtype)
    for r, pages in enumerate(src):
        blob = pool.blob(pages)
        blob[offset : offset + window_bytes] = windows[r].reshape(-1).view(torch.uint8)
        pool.write(pages, blob)
    x = torch.randn(n, dim, generator=g).to(x_dtype)
    taps = torch.randn(taps_n, dim, generator=g)

    y = kernel.conv_step(x, taps, pool.addresses(src), pool.addresses(dst), pool.starts(m), offset,
                         window_dtype == torch.bfloat16)  # fmt: skip

    for r in range(n):
        want_y, want_window = gdn.causal_conv1d(x[r : r + 1], windows[r], taps)
        assert torch.equal(y[r : r + 1], want_y)
        stored = pool.blob(dst[r])[offset : offset + window_bytes].view(window_dtype).view(taps_n - 1, dim)
        assert torch.equal(stored, want_window)


def test_a_slot_past_the_blob_is_refused(kernel):
    pool = Pool([1024], num_blocks=4, seed=9)
    a = pool.addresses([[0]])
    q = torch.zeros(1, 1, 16, 16)[:, :, 0]  # [1, 1, 16]
    v, d = torch.zeros(1, 1, 16), torch.zeros(1, 1)
    with pytest.raises(RuntimeError, match="past the state blob"):
        kernel.delta_step(q, q, v, d, d, a, a, pool.starts(1), 1024 - 16 * 16 * 4 + 4, 0)
