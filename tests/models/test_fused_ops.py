"""The fused elementwise kernels (`models/kernels/fused_ops.cpp`) against plain torch: act(gate) * up for silu
and tanh-GELU, RMSNorm over plain and strided (q/k heads out of a fused projection) rows; a row's bits do not
depend on the rows beside it; unsupported inputs are refused."""

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models.fused import ACT_CODES, fused_ops

ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.fixture(scope="module")
def ops():
    module = fused_ops()
    assert module is not None, "the fused ops kernel did not build (see the log)"
    return module


@pytest.mark.parametrize("act", list(ACT_CODES))
@pytest.mark.parametrize("width", [203, 2048, 7], ids=["tail", "vectors", "scalar-only"])
def test_act_and_mul(ops, act, width):
    x = torch.randn(37, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    gate, up = x.double().split(width, -1)
    want = ACTS[act](gate) * up
    assert (ops.act_and_mul(x, ACT_CODES[act]).double() - want).abs().max() < 2e-5
    got16 = ops.act_and_mul(x.bfloat16(), ACT_CODES[act]).double()
    g16, u16 = x.bfloat16().double().split(width, -1)
    assert ((got16 - ACTS[act](g16) * u16).abs() <= (ACTS[act](g16) * u16).abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_plain_and_strided_rows(ops, dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, generator=g)
    fused = torch.randn(9, 3 * 96 + 40, generator=g).to(dtype)
    heads = fused[:, 40:].view(9, 3, 96)  # strided: row stride 328, head stride 96
    padded = torch.randn(9, 3, 128, generator=g).to(dtype)[:, :, :96]  # head stride 128
    for x in (fused[:, :96], heads, padded, fused[:, 40:136].contiguous()):
        xf = x.double()
        want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        got = ops.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.is_contiguous() and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert ((got.double() - want).abs() <= tol * (want.abs() + 1)).all()


def test_rows_do_not_depend_on_their_neighbours(ops):
    x = torch.randn(64, 2 * 300).bfloat16()
    assert torch.equal(ops.act_and_mul(x[5:6], 1), ops.act_and_mul(x, 1)[5:6])
    w = torch.randn(600)
    assert torch.equal(ops.rms_norm(x[5:6], w, 1e-6), ops.rms_norm(x, w, 1e-6)[5:6])


def test_refuses_what_it_does_not_handle(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.act_and_mul(torch.randn(2, 8).half(), 0)
    with pytest.raises(RuntimeError, match="act"):
        ops.act_and_mul(torch.randn(2, 8), 5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [248_320, 1003, 16, 7], ids=["qwen3.5", "tail", "one-vector", "scalar-only"])
def test_row_argmax_is_torch_argmax(ops, dtype, vocab):
    """Rows as the sampler meets them: random, ties at the maximum (the first wins, also across SIMD lanes and in
    the tail), all -inf, NaN anywhere (torch answers the first NaN), -0.0 beside 0.0, a strided view of rows."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 5, generator=g).to(dtype)[:, :vocab]  # row stride vocab + 5
    x[1, :] = float("-inf")
    x[2, vocab // 3] = x[2, vocab - 1] = 50.0  # a tie between two lanes (or the tail)
    x[3, vocab - 1] = 60.0  # the largest in the tail
    x[4, vocab // 2] = float("nan")
    x[5, [0, vocab - 1]] = float("nan")
    x[6, :] = 0.0
    x[6, vocab // 2] = -0.0
    x[7, 0] = 70.0  # the largest first
    x[8, min(17, vocab - 1)] = x[8, vocab - 1] = 80.0
    want = x.float().argmax(dim=-1)
    assert ops.row_argmax(x).tolist() == want.tolist()


def test_row_argmax_refuses_what_it_cannot_read(ops):
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.row_argmax(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.row_argmax(torch.randn(2, 4).double())
    with pytest.raises(RuntimeError, match="1 to 2"):
        ops.row_argmax(torch.randn(2, 0))


@pytest.mark.parametrize("act", list(ACT_CODES))
def test_bfloat16_rows_are_the_float32_rows_rounded_once(ops, act):
    """A bfloat16 row is computed in float32 from the same values and rounded once, to nearest even: its bits are
    the float32 kernel's output rounded by torch (the vector store's rounding and lane order, and the tail's)."""
    x = (torch.randn(5, 2 * 203, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    want = ops.act_and_mul(x.float(), ACT_CODES[act]).bfloat16()
    assert torch.equal(ops.act_and_mul(x, ACT_CODES[act]), want)
    w = torch.randn(203)
    assert torch.equal(ops.rms_norm(x[:, :203], w, 1e-6), ops.rms_norm(x[:, :203].float(), w, 1e-6).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_apply_rope_bit_for_bit(ops, dtype):
    """The kernel's RoPE equals `rope.apply_rope` bit for bit (the same three roundings in bfloat16), for heads
    viewed out of a fused projection (strided rows and heads) and for contiguous ones, at real positions."""
    from hybridkv.models.rope import Rotary, apply_rope

    tables = Rotary({"rope_type": "default", "rope_theta": 10_000.0}, 128)(torch.arange(3000, 3009), dtype)
    g = torch.Generator().manual_seed(5)
    fused = (torch.randn(9, 6 * 128 + 40, generator=g) * 3).to(dtype)
    strided = fused[:, 40 : 40 + 4 * 128].view(9, 4, 128)  # row stride 808
    for x in (strided, strided.contiguous(), fused[:, 40 + 4 * 128 :].view(9, 2, 128)):
        got = ops.rope(x, tables.cos, tables.sin)
        assert got.is_contiguous() and torch.equal(got, apply_rope(x, tables.cos, tables.sin))


def test_rope_refuses_what_it_does_not_handle(ops):
    x = torch.randn(2, 3, 8)
    with pytest.raises(RuntimeError, match="d even"):
        ops.rope(torch.randn(2, 3, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope(x, torch.randn(2, 1, 8).bfloat16(), torch.randn(2, 1, 8).bfloat16())
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope(x, torch.randn(1, 1, 8), torch.randn(1, 1, 8))
