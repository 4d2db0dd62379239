"""The native prefill kernel (`runner/kernels/paged_prefill.cpp`, bfloat16, AVX512-BF16) against a dense float64
reference, and the property the engine gains from it: a query's bits depend on its own query and visible keys
only, not on how the prompt was chunked, what else shares the call, or the thread count.

The kernel builds everywhere; it says itself whether this CPU runs it (`supported`, compiled for the build
machine's instruction set), which is what `kernels.paged_prefill()` and so the engine go by. Where it does not,
these tests skip and the engine's torch prefill path is checked by tests/engine/test_prefill_kernel.py."""

import functools
import itertools

import pytest
import torch

from hybridkv.native import load_kernel
from hybridkv.runner import kernels
from hybridkv.serve.startup import cpu_info

TOL = 0.02  # bfloat16 inputs and softmax weights: observed errors are under 0.008 on N(0, 1) values


@pytest.fixture(scope="module")
def module():
    built = load_kernel(kernels.SOURCES / "paged_prefill.cpp")
    assert built is not None, "the native prefill kernel did not build (see the log)"
    return built


@pytest.fixture(scope="module", params=["vector", "tiles"])
def prefill(module, request):
    """The kernel with its products on AVX512-BF16 dot products, or on AMX tiles (where this CPU has them): every
    property below holds for both."""
    kernel = kernels.paged_prefill()
    assert (kernel is not None) == module.supported
    if kernel is None:
        pytest.skip("paged_prefill is not supported on this CPU: the engine takes the torch prefill path")
    if request.param == "tiles" and not module.tiles:
        pytest.skip("no AMX tiles on this CPU")
    return functools.partial(module.paged_prefill, tiles=request.param == "tiles")


def test_supported_exactly_where_the_cpu_has_avx512_bf16(module):
    """The kernel runs on every CPU with AVX512-BF16 (and no other): a build that lost it would skip the tests
    below and leave the engine on the torch path unnoticed."""
    assert module.supported == ("avx512_bf16" in cpu_info()[1])
    assert (kernels.paged_prefill() is not None) == module.supported, "what the engine is offered"


def test_tiles_exactly_where_the_cpu_has_amx_unless_capped(module, monkeypatch):
    """AMX tiles run wherever the CPU has AMX-BF16 (a build that lost them would fall back to the vector path
    unnoticed), and not where oneDNN is capped below AMX: one cap runs the process as on a CPU without AMX."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    amx = module.supported and "amx_bf16" in cpu_info()[1]
    assert module.tiles == amx
    if module.supported:
        assert kernels.paged_prefill().keywords["tiles"] == amx
        assert kernels.prefill_path() == ("AMX tiles" if amx else "AVX512-BF16 dot products")
        for cap, tiles in (("AVX512_CORE_BF16", False), ("avx512_core_amx", amx), ("ALL", amx)):
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
            assert kernels.paged_prefill().keywords["tiles"] == tiles, cap


def test_tiles_and_vectors_agree_to_rounding(module):
    """The tile unit sums a pair's products its own way, so the two paths differ in the last bits only."""
    if not module.tiles:
        pytest.skip("no AMX tiles on this CPU")
    cache, tables, bases, qs = requests(3, SPANS, hk=2, groups=4, d=128)
    vector = call(functools.partial(module.paged_prefill, tiles=False), cache, tables, bases, SPANS, qs, 0)
    tiles = call(functools.partial(module.paged_prefill, tiles=True), cache, tables, bases, SPANS, qs, 0)
    for v, t in zip(vector, tiles):
        assert (v.float() - t.float()).abs().max() < 0.02
    assert not all(torch.equal(v, t) for v, t in zip(vector, tiles)), "the same bits: the tile path did not run"


def test_tiles_refused_where_there_are_none(module):
    """Asked for tiles on a CPU (or build) without them, the kernel says so instead of running tile instructions
    the CPU lacks (a SIGILL) or quietly taking the vector path."""
    if module.tiles or not module.supported:
        pytest.skip("this CPU has AMX tiles" if module.tiles else "paged_prefill is not supported on this CPU")
    cache, tables, bases, qs = requests(1, [(0, 30)])
    with pytest.raises(RuntimeError, match="no AMX tiles"):
        call(functools.partial(module.paged_prefill, tiles=True), cache, tables, bases, [(0, 30)], qs, 0)


def reference(q, cache, table, base, start, window, scale, sinks=None):
    """Queries q [n, Hq, D] at positions [start, start + n) over the request's visible keys, in float64."""
    bs, hk = cache.shape[1], cache.shape[3]
    g = q.shape[1] // hk
    out = []
    for i in range(q.shape[0]):
        p = start + i
        lo = max(base, p - window + 1) if window else base
        pos = torch.arange(lo, p + 1)
        kv = cache[table[(pos - base) // bs], (pos - base) % bs].double()  # [T, 2, Hk, D]
        k, v = kv[:, 0].repeat_interleave(g, 1), kv[:, 1].repeat_interleave(g, 1)
        s = torch.einsum("hd,thd->ht", q[i].double(), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1)[:, : k.shape[0]], v))
    return torch.stack(out)


def requests(seed, spans, hk=2, groups=3, d=64, bs=16, window=0, packed=False):
    """A cache and, per (start, n) in `spans`, a request whose queries [start, start + n) see its table's keys."""
    g = torch.Generator().manual_seed(seed)
    layers = 3 if packed else 1
    full = torch.randn(300, layers, bs, 2, hk, d, generator=g).bfloat16()  # packed: [blocks, layers, ...] per layer
    cache = full[:, 1] if packed else full[:, 0]
    bases = [max(0, s - window + 1) // bs * bs if window else 0 for s, _ in spans]
    width = max((s + n - b) // bs + 1 for (s, n), b in zip(spans, bases))
    tables = torch.stack([torch.randperm(299, generator=g)[:width] + 1 for _ in spans])
    qs = [torch.randn(n, hk * groups, d, generator=g).bfloat16() for _, n in spans]
    return cache, tables, bases, qs


def call(prefill, cache, tables, bases, spans, qs, window, scale=0.2, sinks=None):
    offsets = torch.tensor([0, *torch.tensor([n for _, n in spans]).cumsum(0).tolist()])
    starts = torch.tensor([s for s, _ in spans])
    out = prefill(torch.cat(qs), cache, tables, torch.tensor(bases), starts, offsets, window, scale, sinks)
    return out.split([n for _, n in spans])


SPANS = [(0, 70), (100, 50), (600, 40), (5, 1)]  # a prompt from 0, chunks after a prefix, a one-query chunk


@pytest.mark.parametrize("window", [0, 1, 37, 512])
@pytest.mark.parametrize("packed", [False, True], ids=["per-layer", "packed-view"])
def test_matches_dense_reference(prefill, window, packed):
    cache, tables, bases, qs = requests(window, SPANS, window=window, packed=packed)
    outs = call(prefill, cache, tables, bases, SPANS, qs, window)
    for (start, _), q, table, base, got in zip(SPANS, qs, tables, bases, outs):
        want = reference(q, cache, table, base, start, window, 0.2)
        assert (got.double() - want).abs().max() < TOL


@pytest.mark.parametrize("window", [0, 37])
def test_keys_no_query_sees_never_reach_the_output(prefill, window):
    """In the engine a table's slots past a chunk's last query, and before its first query's window, may hold
    another group's bytes (one pool serves attention and state pages): NaN there changes no bit."""
    poisoned = 0
    for start, n in SPANS:
        cache, (table,), (base,), qs = requests(7, [(start, n)], window=window)
        clean = call(prefill, cache, table[None], [base], [(start, n)], qs, window)[0]
        bs = cache.shape[1]
        pos = torch.arange(base, base + table.numel() * bs)
        lo = max(base, start - window + 1) if window else base
        unseen = pos[(pos < lo) | (pos >= start + n)] - base
        cache[table[unseen // bs], unseen % bs] = float("nan")
        poisoned += unseen.numel()
        assert torch.equal(call(prefill, cache, table[None], [base], [(start, n)], qs, window)[0], clean)
    assert poisoned > 0


@pytest.mark.parametrize(("hk", "groups", "d"), [(1, 8, 256), (4, 1, 32), (2, 5, 96), (1, 4, 512)])
def test_head_shapes(prefill, hk, groups, d):
    """Multi-query (8 query heads on one KV head), no GQA, odd group counts (register blocks of 4 rows with a
    tail), head sizes whose value tiles end short (96 = 6 vectors) and Gemma 4's 512."""
    spans = [(0, 45), (200, 33)]
    cache, tables, bases, qs = requests(d, spans, hk=hk, groups=groups, d=d)
    for (start, _), q, table, base, got in zip(
        spans, qs, tables, bases, call(prefill, cache, tables, bases, spans, qs, 0)
    ):
        assert (got.double() - reference(q, cache, table, base, start, 0, 0.2)).abs().max() < TOL


def test_sinks(prefill):
    cache, tables, bases, qs = requests(3, SPANS)
    sinks = torch.linspace(0.0, 8.0, 6)  # e^8 outweighs 600 keys
    outs = call(prefill, cache, tables, bases, SPANS, qs, 0, sinks=sinks)
    for (start, _), q, table, base, got in zip(SPANS, qs, tables, bases, outs):
        want = reference(q, cache, table, base, start, 0, 0.2, sinks)
        assert (got.double() - want).abs().max() < TOL
    plain = call(prefill, cache, tables, bases, SPANS, qs, 0)
    assert all((a.float() - b.float()).abs().max() > 0.05 for a, b in zip(outs, plain))  # the sinks matter


@pytest.mark.parametrize("window", [0, 48])
def test_bits_do_not_depend_on_chunking_batch_or_threads(prefill, window):
    """A 300-token prompt whole, in chunks of 100 / 137 / 63, and next to another request: the same bits."""
    cache, tables, _, (q,) = requests(7, [(0, 300)], window=0)
    table = tables[0]
    whole = call(prefill, cache, tables, [0], [(0, 300)], [q], window)[0]
    for cuts in ([0, 100, 200, 300], [0, 137, 300], [0, 63, 64, 300]):
        parts = []
        for a, b in itertools.pairwise(cuts):
            base = max(0, a - window + 1) // 16 * 16 if window else 0
            parts.append(call(prefill, cache, table[base // 16 :][None], [base], [(a, b - a)], [q[a:b]], window)[0])
        assert torch.equal(torch.cat(parts), whole), cuts
    other = torch.randn(20, 6, 64).bfloat16()
    batched = call(prefill, cache, torch.stack([table, table]), [0, 0], [(40, 20), (0, 300)], [other, q], window)
    assert torch.equal(batched[1], whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(call(prefill, cache, tables, [0], [(0, 300)], [q], window)[0], whole)
    finally:
        torch.set_num_threads(threads)


def test_refuses_queries_outside_the_table(prefill):
    cache, tables, _, qs = requests(1, [(0, 30)])
    with pytest.raises(RuntimeError, match="outside"):
        call(prefill, cache, tables[:, :1], [0], [(0, 30)], qs, 0)  # 30 queries, one 16-slot block
