"""The few-row linear kernel (`models/kernels/packed_rows.cpp`) reads oneDNN's packed bf16 weight in place and
gives oneDNN's bits at every row count, so routing a decode step's rows to it changes nothing; `PackedWeight`
routes only the few rows it wins at, and keeps oneDNN where the load-time probe disagrees.

Which path a weight takes depends on the CPU: the probe (`kernel_matches_onednn`) trusts the kernel where oneDNN
packs the layout it reads (AVX512-BF16 without AMX) and keeps oneDNN elsewhere (AMX CPUs, other oneDNNs). So each
test asks the probe which path this CPU takes, checks that path was taken and gives its reference's bits (the
kernel: oneDNN's bits; oneDNN kept: `PackedWeight.onednn`'s), and runs again with the probe forced to keep oneDNN,
so both paths run on every CPU. `test_a_capped_onednn_keeps_onednn` lets a real probe keep oneDNN: a subprocess
whose oneDNN may not use AVX512-BF16 packs another layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.models import packed_rows
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.packed_rows import PackedWeight, cancelling_probe, layout_bytes, readable_address, rows_kernel
from hybridkv.request.sampling_params import SamplingParams
from tests.tiny_models import build

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN packs no bf16 weights on this CPU"
)

# (N, K): N and K off the 64 / 32 blocks, K at and past oneDNN's 512 / 1024 K blocks
SHAPES = [(100, 72), (130, 1000), (256, 1024), (192, 2048), (64, 3072), (80, 1536), (320, 1100)]
ROWS = (1, 2, 3, 4, 5, 8, 13, 16, 17, 32)  # one register block, several groups of 4, a partial group
needs_kernel = pytest.mark.skipif(rows_kernel() is None, reason="no packed_rows kernel (no AVX512-BF16 or compiler)")


def cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


# Uncapped, oneDNN packs the layout this CPU's kernel reads (packed_tiles on AMX, packed_rows on AVX512-BF16), so
# an honest kernel must be trusted there; capped, it may pack another (`test_a_capped_onednn_keeps_onednn`).
packs_kernel_layout = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags() or "ONEDNN_MAX_CPU_ISA" in os.environ,
    reason="oneDNN packs the kernel's layout on AVX512-BF16 and AMX CPUs, uncapped",
)


class Counting:
    """The kernel module, recording the row count of every call."""

    def __init__(self, rows: list[int], real: object) -> None:
        self.real, self.rows = real, rows

    def linear_rows(self, x, *rest):
        self.rows.append(x.shape[0])
        return self.real.linear_rows(x, *rest)

    def __getattr__(self, name):  # block_n, name
        return getattr(self.real, name)


@pytest.fixture(params=["probe", "onednn-forced"])
def path(request, monkeypatch) -> str:
    """'probe': this CPU's verdicts; 'onednn-forced': the probe keeps oneDNN for every weight."""
    if request.param == "onednn-forced":
        monkeypatch.setattr(packed_rows, "kernel_matches_onednn", lambda n, k: False)
    return request.param


def trusted(n: int, k: int) -> bool:
    """The path the product picks for a bf16 [n, k] weight: its probe's verdict (as the `path` fixture left it)."""
    return packed_rows.kernel_matches_onednn(n, k)


def counting(monkeypatch) -> list[int]:
    """From here on, the row counts of every kernel call `PackedWeight` makes."""
    rows: list[int] = []
    real = rows_kernel()
    if real is not None:
        monkeypatch.setattr(packed_rows, "rows_kernel", lambda: Counting(rows, real))
    return rows


def onednn(x, weight, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias, "none",
                                              [], "")  # fmt: skip


def kernel_disagrees(packed: PackedWeight, weight: torch.Tensor, xs: torch.Tensor) -> bool:
    """Whether the kernel cannot read `packed` or gives other bits than oneDNN for some row count of `xs`: what a
    probe that keeps oneDNN claims."""
    n, k = weight.shape
    address = readable_address(packed.tensor, n, k)
    if rows_kernel() is None or address is None:
        return True
    return any(
        not torch.equal(rows_kernel().linear_rows(xs[:m], address, n, k, None), onednn(xs[:m], weight)) for m in ROWS
    )


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bits_equal_the_reference_of_the_path_taken(n, k, path, monkeypatch):
    g = torch.Generator().manual_seed(n + k)
    weight, probe = cancelling_probe(n, k, g)  # residues: any other summation order shows
    bias = torch.randn(n, generator=g).bfloat16()
    xs = torch.cat([probe, torch.randn(max(ROWS), k, generator=g).bfloat16()])
    kernel = trusted(n, k)
    packed = PackedWeight(weight)
    assert (packed.address is not None) == kernel
    assert (onednn(probe[:1], weight) != 0).float().mean() > 0.5, "the probe should leave rounding residues"
    if path == "probe" and not kernel:
        disagrees = kernel_disagrees(packed, weight, xs)
        assert disagrees, "the probe kept oneDNN where the kernel gives oneDNN's bits"
    calls = counting(monkeypatch)
    for m in ROWS:
        for b in (None, bias):
            want = onednn(xs[:m], weight, b)
            assert torch.equal(packed.onednn(xs[:m], b), want)
            assert torch.equal(packed(xs[:m], b), want), (m, b is not None)
            if kernel:
                assert torch.equal(rows_kernel().linear_rows(xs[:m], packed.address, n, k, b), want), m
    assert bool(calls) == kernel, "the kernel runs exactly where the probe trusts it"
    if kernel:
        assert torch.ops.mkldnn._nbytes(packed.tensor) == layout_bytes(n, k)


def test_strided_rows_are_read_as_rows(path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    wide = torch.randn(3, 200, generator=g).bfloat16()
    x = wide[:, 10:74]  # row stride 200, K = 64
    kernel = trusted(96, 64)
    packed = PackedWeight(weight)
    assert (packed.address is not None) == kernel
    want = onednn(x.contiguous(), weight)
    calls = counting(monkeypatch)
    assert torch.equal(packed(x, None), want)
    assert calls == ([3] if kernel else [])
    if kernel:
        assert torch.equal(rows_kernel().linear_rows(x, packed.address, 96, 64, None), want)


@pytest.mark.parametrize(("threads", "kernel_rows"), [(1, (1, 4, 5, 16, 17, 32)), (2, (1, 4, 5, 16))])
def test_routes_only_the_rows_it_wins_at(monkeypatch, threads, kernel_rows, path):
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    kernel = trusted(128, 256)
    packed = PackedWeight(weight)
    calls = counting(monkeypatch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for m in (1, 4, 5, 16, 17, 32, 33):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(packed(x, None), onednn(x, weight))
    assert tuple(calls) == (kernel_rows if kernel else ())
    assert PackedWeight(weight.float()).address is None, "float32 weights stay on oneDNN"


@needs_kernel
def test_a_probe_that_disagrees_keeps_onednn(monkeypatch):
    real = rows_kernel()

    class OffByOneUlp(Counting):
        def linear_rows(self, x, address, n, k, bias):
            out = real.linear_rows(x, address, n, k, bias)
            return (out.view(torch.int16) + (out != 0)).view(torch.bfloat16)

    monkeypatch.setattr(packed_rows, "rows_kernel", lambda: OffByOneUlp([], real))
    packed_rows.kernel_matches_onednn.cache_clear()
    try:
        assert PackedWeight(torch.randn(64, 96).bfloat16()).address is None
    finally:
        packed_rows.kernel_matches_onednn.cache_clear()


@needs_kernel
@packs_kernel_layout
@pytest.mark.parametrize("rows", packed_rows.PROBE_ROWS)
def test_the_probe_checks_the_last_row_of_every_probed_row_count(monkeypatch, rows):
    """A kernel right everywhere but in the last row of one row count, which it sums exactly (float64, as if in
    another order): against the cancelling weight that row must be ones, where any order but oneDNN's shows, and
    the probe must compare it. oneDNN is kept; the honest kernel is trusted for the same shape."""
    real, n, k = rows_kernel(), 96, 160
    weights: list[torch.Tensor] = []
    probe = packed_rows.cancelling_probe

    def recording_probe(*args) -> tuple[torch.Tensor, torch.Tensor]:
        weight, x = probe(*args)
        weights.append(weight)
        return weight, x

    monkeypatch.setattr(packed_rows, "cancelling_probe", recording_probe)

    class OtherOrderInOneRow(Counting):
        def linear_rows(self, x, address, n, k, bias):
            out = real.linear_rows(x, address, n, k, bias)
            if x.shape[0] == rows:
                out[-1] = (x[-1].double() @ weights[-1].double().T).to(torch.bfloat16)
            return out

    packed_rows.kernel_matches_onednn.cache_clear()
    try:
        assert PackedWeight(torch.randn(n, k).bfloat16()).address is not None, "the honest kernel is not trusted"
        packed_rows.kernel_matches_onednn.cache_clear()
        monkeypatch.setattr(packed_rows, "rows_kernel", lambda: OtherOrderInOneRow([], real))
        assert PackedWeight(torch.randn(n, k).bfloat16()).address is None
    finally:
        packed_rows.kernel_matches_onednn.cache_clear()


@needs_kernel
def test_refuses_what_it_cannot_read():
    """The kernel's own checks, whatever the probe decides: any 64-byte aligned span of the layout's size."""
    span = torch.zeros(layout_bytes(64, 64) + 64, dtype=torch.uint8)
    address = span.data_ptr() + (-span.data_ptr()) % 64
    ops = rows_kernel()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        ops.linear_rows(torch.randn(1, 64), address, 64, 64, None)
    with pytest.raises(RuntimeError, match="aligned"):
        ops.linear_rows(torch.randn(1, 64).bfloat16(), address + 2, 64, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_rows(torch.randn(1, 64).bfloat16(), address, 64, 64, torch.zeros(63).bfloat16())
    with pytest.raises(RuntimeError, match="features"):  # reading past the weight
        ops.linear_rows(torch.randn(1, 128).bfloat16(), address, 64, 64, None)
    assert ops.linear_rows(torch.zeros(1, 64).bfloat16(), address, 64, 64, None).shape == (1, 64)
    if ops.name == "packed_tiles":  # two groups of 16 rows at most
        with pytest.raises(RuntimeError, match="at most 32 rows"):
            ops.linear_rows(torch.zeros(33, 64).bfloat16(), address, 64, 64, None)
    packed = PackedWeight(torch.randn(64, 64).bfloat16())
    with pytest.raises(RuntimeError):  # the same through the module, either path: a refusal, not a stray read
        packed(torch.randn(1, 128).bfloat16(), None)


def packed_weights(model: torch.nn.Module) -> list[PackedWeight]:
    """Every packed weight of a model: `Linear.packed`, `FusedLinear.packed`, `TiedLogits.packed`."""
    values = [v for m in model.modules() for v in vars(m).values()]
    return [w for v in values for w in [v.packed if isinstance(v, FusedLinear) else v] if isinstance(w, PackedWeight)]


def test_engine_decode_takes_the_probed_path_and_keeps_its_bits(tmp_path, monkeypatch, path):
    """A bf16 model whose K crosses oneDNN's 512 block (intermediate 1100): one request decodes through the path
    each weight's probe chose, and its tokens and logprobs equal a run whose linears all stay on oneDNN."""
    folder = build("qwen3", tmp_path / "m", head_dim=32, hidden_size=128, intermediate_size=1100)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [list(range(7, 47))]

    def run(limit):
        monkeypatch.setattr(packed_rows, "ROW_THREADS_LIMIT", limit)
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="32MiB")
        with monkeypatch.context() as m:
            rows = counting(m)
            out = llm.generate(prompt, params)[0].outputs[0]
        return out.token_ids, [lp.logprob for lp in out.logprobs], rows, packed_weights(llm.engine.model)

    fast_tokens, fast_logprobs, rows, weights = run(torch.get_num_threads())  # one row per thread
    slow_tokens, slow_logprobs, none, _ = run(0)
    assert len(weights) == 17  # 4 layers x (qkv, o, gate_up, down) and the lm_head
    taken = [w.address is not None for w in weights]
    assert taken == [trusted(w.out_features, w.in_features) for w in weights], "each weight takes its probe's path"
    if any(taken):
        assert set(rows) == {1} and len(rows) >= 15 * sum(taken), "every decode step's trusted linears use the kernel"
    else:
        assert rows == []
    assert not none
    assert fast_tokens == slow_tokens and fast_logprobs == slow_logprobs


def report_capped_paths() -> None:
    """Run in a subprocess whose oneDNN is capped: per shape, the probe's verdict, whether the kernel really
    disagrees, the path taken and whether every row count gave oneDNN's bits."""
    torch.set_num_threads(1)  # as tests/conftest.py: a few rows take the kernel
    out = []
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        weight, probe = cancelling_probe(n, k, g)
        xs = torch.cat([probe, torch.randn(max(ROWS), k, generator=g).bfloat16()])
        packed = PackedWeight(weight)
        out.append(
            {
                "trusted": trusted(n, k),
                "disagrees": kernel_disagrees(packed, weight, xs),
                "kernel_path": packed.address is not None,
                "bits": all(torch.equal(packed(xs[:m], None), onednn(xs[:m], weight)) for m in ROWS),
            }
        )
    print(json.dumps(out))


@needs_kernel
@packs_kernel_layout
def test_the_kernel_is_trusted_where_onednn_packs_its_layout():
    """The probe keeps oneDNN wherever the kernel disagrees, so a kernel bug alone would pass every bit test by
    turning the fast path off. On the CPUs the kernel is written for, it must be on for every shape: on AMX every
    shape with K >= 256 (oneDNN multiplies a small K, 40 or 72, outside its tiles for 2+ rows; measured)."""
    tiles = rows_kernel().name == "packed_tiles"
    shapes = [(n, k) for n, k in SHAPES if not tiles or k >= 256]
    assert len(shapes) >= len(SHAPES) - 1
    assert all(packed_rows.kernel_matches_onednn(n, k) for n, k in shapes)


@needs_kernel
def test_a_capped_onednn_keeps_onednn():
    """With ONEDNN_MAX_CPU_ISA=AVX512_CORE oneDNN packs bf16 weights for another ISA (as an AMX CPU's does): the
    real probe must see that the kernel cannot give its bits, and keep oneDNN, bit for bit."""
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "HYBRIDKV_KERNELS": "native"}
    root = Path(__file__).parents[2]
    code = "from tests.models.test_packed_rows import report_capped_paths; report_capped_paths()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])
    for shape, s in zip(SHAPES, shapes):
        assert s["trusted"] == (not s["disagrees"]) == s["kernel_path"], (shape, s)
        assert s["bits"], shape
    if not any(s["disagrees"] for s in shapes):
        pytest.skip("this oneDNN packs the kernel's layout even capped at AVX512_CORE: no fallback to exercise")
