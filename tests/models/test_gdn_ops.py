"""Gated DeltaNet's elementwise kernels (`models/kernels/gdn_ops.cpp`, the packed path of `qwen3_5_gdn.py`)
against float64 references: the gates, a one-token step's inputs (silu, l2norm, head
expansion, decay), the gated output norm; a row's bits do not depend on the rows beside it; bad shapes are
refused."""

import pytest
import torch

from hybridkv.models.qwen3_5_gdn import SOURCE
from hybridkv.native import load_kernel

HK, HV, DK, DV = 2, 4, 32, 24  # two value heads per key head; dv not a multiple of 16 (a scalar tail)


@pytest.fixture(scope="module")
def ops():
    module = load_kernel(SOURCE)
    assert module is not None, "the gdn_ops kernel did not build (see the log)"
    return module


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool(((got.double() - want).abs() <= want.abs() * rel + 1e-6).all())


def test_gates(ops):
    fused = rand(33, 3 + 2 * HV, seed=1, scale=12)  # b and a strided out of a fused projection, |a| past 20
    b, a = fused[:, 3 : 3 + HV], fused[:, 3 + HV :]
    rate, bias = -rand(HV, seed=2).exp(), rand(HV, seed=3)
    g, beta = ops.gdn_gates(b, a, rate, bias)
    x = a.double() + bias.double()
    want_g = rate.double() * torch.where(x > 20, x, torch.nn.functional.softplus(x))
    assert close(g, want_g, 2e-6) and close(beta, torch.sigmoid(b.double()), 2e-6)
    g16, beta16 = ops.gdn_gates(b.bfloat16(), a.bfloat16(), rate, bias)
    x16 = a.bfloat16().double() + bias.double()
    assert close(g16, rate.double() * torch.where(x16 > 20, x16, torch.nn.functional.softplus(x16)), 2e-6)
    assert close(beta16, torch.sigmoid(b.bfloat16().double()), 2e-6)
    for r in (0, 17, 32):  # a row alone: the same bits
        one = ops.gdn_gates(b[r : r + 1], a[r : r + 1], rate, bias)
        assert torch.equal(one[0][0], g[r]) and torch.equal(one[1][0], beta[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_inputs(ops, dtype):
    n = 9
    mixed = rand(n, 2 * HK * DK + HV * DV, seed=4, scale=3).to(dtype)
    g = -rand(n, HV, seed=5).abs()
    q, k, v, decay = ops.gdn_step_inputs(mixed, g, HK, DK)
    act = torch.nn.functional.silu(mixed.double())
    qh, kh, vh = act.split((HK * DK, HK * DK, HV * DV), -1)

    def normed(x: torch.Tensor) -> torch.Tensor:  # [n, Hk, dk] -> [n, Hv, dk], value head h reads key head h // 2
        x = x.reshape(n, HK, DK)
        return (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(HV // HK, 1)

    want = (normed(qh) * DK**-0.5, normed(kh), vh.reshape(n, HV, DV), g.double().exp())
    for got, w in zip((q, k, v, decay), want, strict=True):
        assert got.dtype == torch.float32 and got.shape == w.shape and close(got, w, 3e-6)
    for r in (0, 4, 8):  # a row alone, and a row out of a wider (strided) tensor: the same bits
        wide = torch.cat((mixed[r : r + 1], mixed[r : r + 1, :7]), -1)[:, : mixed.shape[1]]
        for x in (mixed[r : r + 1], wide):
            one = ops.gdn_step_inputs(x, g[r : r + 1].contiguous(), HK, DK)
            assert all(torch.equal(o[0], full[r]) for o, full in zip(one, (q, k, v, decay), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(ops, dtype):
    n, eps = 7, 1e-6
    o, z, w = rand(n, HV, DV, seed=6).to(dtype), rand(n, HV * DV, seed=7, scale=3).to(dtype), rand(DV, seed=8)
    got = ops.gated_rms_norm(o, z, w, eps)
    od = o.double()
    normed = od * torch.rsqrt(od.square().mean(-1, keepdim=True) + eps) * w.double()
    want = (normed * torch.nn.functional.silu(z.double().view(n, HV, DV))).view(n, HV * DV)
    assert got.dtype == dtype and close(got, want, 2e-6 if dtype == torch.float32 else 2**-8)
    for r in (0, 6):
        assert torch.equal(ops.gated_rms_norm(o[r : r + 1], z[r : r + 1], w, eps)[0], got[r])


def test_bad_shapes_are_refused(ops):
    mixed, g = torch.zeros(2, 2 * HK * DK + HV * DV), torch.zeros(2, HV)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.gdn_step_inputs(mixed, g, HK + 1, DK)  # 4 value heads over 3 key heads
    with pytest.raises(RuntimeError, match="same shape"):
        ops.gdn_gates(torch.zeros(2, HV), torch.zeros(3, HV), torch.ones(HV), torch.ones(HV))
    with pytest.raises(RuntimeError, match="z must be"):
        ops.gated_rms_norm(torch.zeros(2, HV, DV), torch.zeros(2, HV * DV + 1), torch.ones(DV), 1e-6)
