"""The Gated DeltaNet kernels alone: bitwise under aligned splits, close to the one-token recurrence and to
transformers' reference torch kernels, a causal conv that carries its window, and size-independent activations."""

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models import exact
from hybridkv.models import gated_deltanet as gdn

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

T, HK, HV, DK, DV = 256, 2, 4, 16, 32  # Hk != Hv and dk != dv: a head or state-axis mixup changes results
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inputs(seed: int = 0, slow: bool = True) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta, state: decays from near 1 (the state lives across chunks) to fast, a non-zero state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, HK, DK, generator=gen), torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    rate = torch.tensor([0.002, 0.02, 0.2, 1.0]) if slow else torch.full((HV,), 2.0)
    g = -torch.rand(T, HV, generator=gen) * rate
    beta = torch.rand(T, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def scan(x: tuple[torch.Tensor, ...], a: int, b: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, beta, _ = x
    return gdn.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, start=a)


def scan_in_calls(x: tuple[torch.Tensor, ...], cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run [0, T) as calls ending at `cuts`, carrying the state."""
    outs, state, a = [], x[-1], 0
    for b in cuts:
        out, state = scan(x, a, b, state)
        outs.append(out)
        a = b
    return torch.cat(outs), state


@pytest.mark.parametrize("slow", [True, False])
@pytest.mark.parametrize("cuts", [[64, T], [128, T], [192, T], [64, 128, 192, T]])
def test_split_at_chunk_multiples_is_bitwise(slow, cuts):
    x = inputs(slow=slow)
    whole_out, whole_state = scan_in_calls(x, [T])
    out, state = scan_in_calls(x, cuts)
    assert torch.equal(out, whole_out)
    assert torch.equal(state, whole_state)


def test_chunk_grid_is_anchored_at_absolute_positions():
    assert gdn.chunk_bounds(0, 150) == [(0, 64), (64, 128), (128, 150)]
    assert gdn.chunk_bounds(100, 156) == [(0, 28), (28, 92), (92, 156)]
    assert gdn.chunk_bounds(128, 1) == [(0, 1)]
    # A call that starts off the grid is still the same rule (its first chunk is partial), only not bitwise.
    x = inputs()
    whole_out, whole_state = scan_in_calls(x, [T])
    out, state = scan_in_calls(x, [100, T])
    torch.testing.assert_close(out, whole_out, atol=TOL, rtol=0)
    torch.testing.assert_close(state, whole_state, atol=TOL, rtol=0)


@pytest.mark.parametrize("slow", [True, False])
def test_chunked_scan_matches_recurrence(slow):
    q, k, v, g, beta, state = x = inputs(slow=slow)
    out, final = scan_in_calls(x, [T])
    step_out, step_state = [], state
    for t in range(T):  # one token per call, as decode runs it
        o, step_state = gdn.recurrent_gated_delta_rule(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], step_state
        )
        step_out.append(o)
    torch.testing.assert_close(torch.cat(step_out), out, atol=TOL, rtol=0)
    torch.testing.assert_close(step_state, final, atol=TOL, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 63, 150, T])
def test_matches_transformers_kernels(n):
    *xs, state = inputs()
    q, k, v, g, beta = (t[:n] for t in xs)
    theirs, their_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ours, our_state = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(ours, theirs[0], atol=TOL, rtol=0)
    torch.testing.assert_close(our_state, their_state[0], atol=TOL, rtol=0)

    theirs, their_state = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ours, our_state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(ours, theirs[0], atol=TOL, rtol=0)
    torch.testing.assert_close(our_state, their_state[0], atol=TOL, rtol=0)


def test_state_dtype_is_cast_not_kept():
    q, k, v, g, beta, state = inputs()
    _, final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state.to(torch.bfloat16))
    assert final.dtype == torch.float32 and final.shape == (HV, DK, DV)


def test_causal_conv_matches_conv1d_and_carries_its_window():
    gen = torch.Generator().manual_seed(0)
    taps, dim = 4, 24
    x, weight = torch.randn(T, dim, generator=gen), torch.randn(taps, dim, generator=gen)
    y, window = gdn.causal_conv1d(x, torch.zeros(taps - 1, dim), weight)
    reference = F.conv1d(x.t()[None], weight.t()[:, None], padding=taps - 1, groups=dim)[0, :, :T].t()
    torch.testing.assert_close(y, reference, atol=1e-6, rtol=0)
    assert torch.equal(window, x[-(taps - 1) :])
    for cut in (1, 2, 3, 50, 64, 255):  # any split, since the conv is element-wise
        y1, w1 = gdn.causal_conv1d(x[:cut], torch.zeros(taps - 1, dim), weight)
        y2, w2 = gdn.causal_conv1d(x[cut:], w1, weight)
        assert torch.equal(torch.cat((y1, y2)), y) and torch.equal(w2, window)


@pytest.mark.parametrize(
    ("ours", "torch_fn"), [(exact.silu, F.silu), (exact.sigmoid, torch.sigmoid), (exact.softplus, F.softplus)]
)
def test_activations_do_not_depend_on_the_tensor_size(ours, torch_fn):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 8
    x[:4] = torch.tensor([30.0, -30.0, 20.5, -100.0])
    whole = ours(x)
    for n in [*range(1, 130), 1001, 4097]:
        assert torch.equal(ours(x[:n].clone()), whole[:n]), n
        assert torch.equal(ours(x[7 : 7 + n].clone()), whole[7 : 7 + n]), n
    torch.testing.assert_close(whole, torch_fn(x), atol=1e-6, rtol=1e-6)
