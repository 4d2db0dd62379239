"""The Mamba2 kernels (hybridkv.models.mamba2): split invariance (bitwise at multiples of the chunk size), the
chunk scan against the recurrence, and both against transformers' torch reference of the Nemotron-H mixer."""

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models.mamba2 import causal_conv, chunk_bounds, ssd_chunk_scan, ssd_step
from hybridkv.models.nemotron_h import Mamba2Mixer, model_config
from hybridkv.models.reference_states import ReferenceStates
from tests.models.tiny_nemotron_h import NEMOTRON_H_TINY, nemotron_h_config, randomize_nemotron_h

hf_nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

T, H, P, G, N, C = 150, 8, 16, 2, 16, 32
TOL = 1e-5


@pytest.fixture(scope="module")
def inputs():
    """One sequence of scan inputs with decays per token exp(dt A) between ~0.4 and ~1, and an initial state."""
    g = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(T, H, P, generator=g),
        dt=torch.exp(torch.empty(T, H).uniform_(-5, -1, generator=g)),
        a=-torch.empty(H).uniform_(0.5, 4, generator=g),
        b=torch.randn(T, G, N, generator=g),
        c=torch.randn(T, G, N, generator=g),
        d=torch.rand(H, generator=g) + 0.5,
        state=torch.randn(H, P, N, generator=g) * 0.5,
    )


def scan(inp, t0: int, t1: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sl = slice(t0, t1)
    return ssd_chunk_scan(inp["x"][sl], inp["dt"][sl], inp["a"], inp["b"][sl], inp["c"][sl], inp["d"], state, t0, C)


def scan_pieces(inp, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    state, ys = inp["state"].clone(), []
    for t0, t1 in pairwise(cuts):
        y, state = scan(inp, t0, t1, state)
        ys.append(y)
    return torch.cat(ys), state


def test_chunk_bounds_sit_on_the_absolute_grid():
    assert chunk_bounds(0, 70, 32) == [(0, 32), (32, 64), (64, 70)]
    assert chunk_bounds(50, 60, 32) == [(0, 14), (14, 46), (46, 60)]
    assert chunk_bounds(64, 2, 32) == [(0, 2)]


@pytest.mark.parametrize("cuts", [[0, 32, 150], [0, 64, 150], [0, 128, 150], [0, 32, 96, 128, 150]])
def test_split_at_chunk_multiples_is_bitwise(inputs, cuts):
    whole_y, whole_state = scan_pieces(inputs, [0, T])
    y, state = scan_pieces(inputs, cuts)
    assert torch.equal(y, whole_y)
    assert torch.equal(state, whole_state)


def test_call_off_the_grid_realigns_at_the_next_multiple(inputs):
    # a call starting at 50 runs [50, 64) as a partial chunk, so cutting it at 64 changes nothing
    y, state = scan_pieces(inputs, [0, 50, 150])
    y2, state2 = scan_pieces(inputs, [0, 50, 64, 150])
    assert torch.equal(y, y2) and torch.equal(state, state2)


@pytest.mark.parametrize("end", [129, 140, 149])
def test_outputs_do_not_depend_on_where_the_call_ends(inputs, end):
    # a partial last chunk is padded to the chunk size, so its tokens see the same ops as in a longer call
    whole_y, _ = scan_pieces(inputs, [0, T])
    y, _ = scan_pieces(inputs, [0, end])
    assert torch.equal(y, whole_y[:end])


def test_unaligned_split_is_close(inputs):
    whole_y, whole_state = scan_pieces(inputs, [0, T])
    y, state = scan_pieces(inputs, [0, 1, 31, 100, 150])
    assert (y - whole_y).abs().max() <= TOL and (state - whole_state).abs().max() <= TOL


def test_chunk_scan_matches_the_recurrence(inputs):
    whole_y, whole_state = scan_pieces(inputs, [0, T])
    state, ys = inputs["state"].clone(), []
    for t in range(T):
        i = inputs
        y, state = ssd_step(i["x"][t], i["dt"][t], i["a"], i["b"][t], i["c"][t], i["d"], state)
        ys.append(y)
    assert (torch.stack(ys) - whole_y).abs().max() <= TOL
    assert (state - whole_state).abs().max() <= TOL


def test_chunk_scan_matches_transformers(inputs):
    i = inputs
    ours, our_state = scan_pieces(i, [0, T])
    theirs, their_state = hf_nemotron.mamba2_chunk_scan(
        i["x"][None], i["dt"][None], i["a"], i["b"][None], i["c"][None], chunk_size=C, D=i["d"],
        initial_states=i["state"][None], return_final_states=True,
    )  # fmt: skip
    assert (ours - theirs[0]).abs().max() <= TOL
    assert (our_state - their_state[0]).abs().max() <= TOL


def test_step_matches_transformers(inputs):
    i, t = inputs, 7
    ours, our_state = ssd_step(i["x"][t], i["dt"][t], i["a"], i["b"][t], i["c"][t], i["d"], i["state"])
    their_state = i["state"][None].clone()
    theirs = hf_nemotron.mamba2_selective_state_update(
        their_state, i["x"][t][None], i["dt"][t][None, :, None].expand(1, H, P),
        i["a"][:, None, None].expand(H, P, N), i["b"][t][None], i["c"][t][None], i["d"][:, None].expand(H, P),
    )  # fmt: skip
    assert (ours - theirs[0]).abs().max() <= TOL
    assert (our_state - their_state[0]).abs().max() <= TOL


def test_causal_conv_is_split_invariant_and_matches_conv1d():
    g = torch.Generator().manual_seed(3)
    k, dim, t = 4, 24, 40
    x, w, bias = torch.randn(t, dim, generator=g), torch.randn(dim, k, generator=g), torch.randn(dim, generator=g)
    y, state = causal_conv(x, torch.zeros(k - 1, dim), w, bias)
    ref = F.conv1d(x.t()[None], w[:, None], bias, padding=k - 1, groups=dim)[0, :, :t].t()
    assert (y - ref).abs().max() <= 1e-5
    assert torch.equal(state, x[-(k - 1) :])
    for cut in (1, 2, 17):  # any split (also shorter than the window): the same bits
        y1, s1 = causal_conv(x[:cut], torch.zeros(k - 1, dim), w, bias)
        y2, s2 = causal_conv(x[cut:], s1, w, bias)
        assert torch.equal(torch.cat([y1, y2]), y) and torch.equal(s2, state)


@pytest.mark.parametrize("cuts", [[0, 150], [0, 64, 149, 150]])
def test_mixer_matches_transformers(cuts):
    """Our Mamba2 mixer with transformers' weights against its torch path: whole prompt without a cache, and
    with its cache over the same pieces (chunk path for multi-token pieces, its one-token path for the last)."""
    cfg = nemotron_h_config()
    torch.manual_seed(0)
    theirs = hf_nemotron.NemotronHForCausalLM(cfg).float().eval()
    randomize_nemotron_h(theirs)
    hf_mixer = theirs.model.layers[0].mixer
    ours = Mamba2Mixer(model_config(cfg.to_dict()))
    ours.load_state_dict(hf_mixer.state_dict())
    x = torch.randn(T, NEMOTRON_H_TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
    states = ReferenceStates({0: ours.state_shapes()})
    cache = hf_nemotron.DynamicCache(config=cfg) if len(cuts) > 2 else None
    with torch.no_grad():
        for t0, t1 in pairwise(cuts):
            y = ours(0, x[t0:t1], states.for_tokens(t1 - t0), [t0])
            ref = hf_mixer(x[None, t0:t1], cache=cache)[0]
            assert (y - ref).abs().max() <= TOL
    if cache is not None:
        assert (states.ssm[0] - cache.get_recurrent_state(0, state_idx=0)[0]).abs().max() <= TOL
