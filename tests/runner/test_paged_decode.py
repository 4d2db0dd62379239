"""The native decode kernel (`runner/kernels/paged_decode.cpp`) against a dense float64 reference, and the
properties the engine relies on: a request's bits do not depend on its batch or the thread count, strided
(packed cross-layer) cache views read right, sinks, and a position outside its table is refused."""

import pytest
import torch

from hybridkv.runner import kernels


@pytest.fixture(scope="module")
def decode():
    kernel = kernels.paged_decode()
    assert kernel is not None, "the native decode kernel did not build (see the log)"
    return kernel


def reference(q, cache, tables, bases, positions, window, scale, sinks=None):
    """Dense attention of q [B, Hq, D] over each request's visible keys, in float64."""
    bs, hk = cache.shape[1], cache.shape[3]
    outs = []
    for r in range(q.shape[0]):
        p, base = int(positions[r]), int(bases[r])
        lo = max(base, p - window + 1) if window else base
        pos = torch.arange(lo, p + 1)
        kv = cache[tables[r][(pos - base) // bs], (pos - base) % bs].double()  # [T, 2, Hk, D]
        g = q.shape[1] // hk
        k, v = kv[:, 0].repeat_interleave(g, 1), kv[:, 1].repeat_interleave(g, 1)
        s = torch.einsum("hd,thd->ht", q[r].double(), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        w = s.softmax(-1)[:, : k.shape[0]]
        outs.append(torch.einsum("ht,thd->hd", w, v))
    return torch.stack(outs)


def case(seed, dtype=torch.float32, b=5, hk=2, groups=3, d=64, bs=16, window=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    layers = 3 if packed else 1
    # A packed cross-layer cache: [blocks, layers, bs, 2, hk, d] viewed per layer (strided over blocks).
    full = torch.randn(200, layers, bs, 2, hk, d, generator=g).to(dtype)
    cache = full[:, 1] if packed else full[:, 0]
    positions = torch.randint(0, 600, (b,), generator=g)
    bases = (positions - window + 1).clamp(min=0) // bs * bs if window else torch.zeros(b, dtype=torch.long)
    span = int(((positions - bases) // bs).max()) + 1
    tables = torch.stack([torch.randperm(199, generator=g)[:span] + 1 for _ in range(b)])
    q = torch.randn(b, hk * groups, d, generator=g).to(dtype)
    return q, cache, tables, bases, positions, window


@pytest.mark.parametrize("window", [0, 1, 37, 512])
@pytest.mark.parametrize("packed", [False, True], ids=["per-layer", "packed-view"])
def test_matches_dense_reference(decode, window, packed):
    q, cache, tables, bases, positions, window = case(window, window=window, packed=packed)
    got = decode(q, cache, tables, bases, positions, window, 0.3, None)
    assert (got.double() - reference(q, cache, tables, bases, positions, window, 0.3)).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("groups", "d"),
    [(8, 48), (5, 256), (1, 16), (2, 24), (3, 20)],
    ids=["two-head-blocks-short-tile", "head-block-tail-two-tiles", "one-query-head", "d24", "generic-path-d20"],
)
def test_head_shapes(decode, groups, d):
    """The vector paths' head pairs and value tiles with their tails; a head size of 24 takes the AVX2 path on
    CPUs without AVX-512 and the generic one on AVX-512 CPUs (not a multiple of 16); 20 takes the generic path
    everywhere."""
    q, cache, tables, bases, positions, window = case(groups * d, groups=groups, d=d)
    got = decode(q, cache, tables, bases, positions, window, 0.3, None)
    assert (got.double() - reference(q, cache, tables, bases, positions, window, 0.3)).abs().max() < 1e-5


def test_bfloat16_and_sinks(decode):
    q, cache, tables, bases, positions, window = case(1, dtype=torch.bfloat16, d=128)
    want = reference(q, cache, tables, bases, positions, window, 0.1)
    assert (decode(q, cache, tables, bases, positions, 0, 0.1, None).double() - want).abs().max() < 2e-2
    sinks = torch.linspace(-2, 3, q.shape[1])
    q, cache, tables, bases, positions, _ = case(2)
    want = reference(q, cache, tables, bases, positions, 0, 0.3, sinks)
    assert (decode(q, cache, tables, bases, positions, 0, 0.3, sinks).double() - want).abs().max() < 1e-5


def test_request_bits_do_not_depend_on_batch_or_threads(decode):
    q, cache, tables, bases, positions, _ = case(3, b=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = decode(q, cache, tables, bases, positions, 0, 0.3, None)
        torch.set_num_threads(2)
        for r in range(q.shape[0]):
            one = slice(r, r + 1)
            alone = decode(q[one].contiguous(), cache, tables[one], bases[one], positions[one], 0, 0.3, None)
            assert torch.equal(alone[0], batch[r])
    finally:
        torch.set_num_threads(threads)


def test_position_outside_the_table_is_refused(decode):
    q, cache, tables, bases, positions, _ = case(4)
    positions = positions.clone()
    positions[0] = tables.shape[1] * 16  # one slot past the last listed block
    with pytest.raises(RuntimeError, match="outside its block table"):
        decode(q, cache, tables, bases, positions, 0, 0.3, None)
