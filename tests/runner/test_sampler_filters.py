"""top-k and top-p against the exact filtered distribution (vLLM's semantics): top-k keeps the k largest logits
(and every logit tied with the k-th), top-p then keeps, most probable first, tokens until their cumulative
probability reaches top_p, always at least one; what is left is renormalized and drawn from.

The distribution the sampler draws from is read where it is drawn (torch.multinomial), so the allowed set and its
weights are compared exactly; the draws themselves are checked against it with a chi-square bound."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.request.sampling_params import SamplingParams
from hybridkv.runner.sampler import sample

# Ten tokens, no two logits equal; token ids are not in probability order.
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.9, -0.4, 1.6, 0.0, -2.5, 1.0])


def reference(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> dict[int, float]:
    """token -> probability after the filters, computed independently in float64 (ties: lower token id first)."""
    z = [float(v) / temperature for v in logits.double()]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    allowed = order if top_k <= 0 else [i for i in order if z[i] >= z[order[min(top_k, len(z)) - 1]]]
    total = sum(math.exp(z[i]) for i in allowed)
    probs = {i: math.exp(z[i]) / total for i in allowed}
    if top_p < 1.0:
        kept, mass = {}, 0.0
        for i in allowed:  # most probable first
            if kept and mass >= top_p:
                break
            kept[i] = probs[i]
            mass += probs[i]
        probs = {i: p / mass for i, p in kept.items()}
    return probs


def drawn_from(monkeypatch, logits: torch.Tensor, params: SamplingParams) -> dict[int, float]:
    """The renormalized distribution sample() draws from for one row: token -> probability, zeros left out."""
    seen = []
    draw = torch.multinomial

    def recording(probs, *args, **kw):
        seen.append(probs.clone())
        return draw(probs, *args, **kw)

    monkeypatch.setattr(torch, "multinomial", recording)
    sample(logits[None].clone(), [params], [torch.Generator().manual_seed(0)])
    monkeypatch.setattr(torch, "multinomial", draw)
    (probs,) = seen
    probs = probs.double() / probs.double().sum()
    return {i: float(p) for i, p in enumerate(probs) if p > 0}


def assert_same_distribution(ours: dict[int, float], expected: dict[int, float]) -> None:
    assert set(ours) == set(expected)
    for i, p in expected.items():
        assert ours[i] == pytest.approx(p, rel=1e-5, abs=1e-7), (i, ours, expected)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 1234) -> list[int]:
    """n tokens drawn through sample() from the same row, one generator advancing across them."""
    g = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1).clone(), [params] * n, [g] * n)


def assert_frequencies_match(tokens: list[int], expected: dict[int, float]) -> None:
    """No token outside the allowed set; a chi-square statistic far below anything a wrong distribution gives."""
    assert set(tokens) <= set(expected), sorted(set(tokens) - set(expected))
    n, df = len(tokens), len(expected) - 1
    if df == 0:
        return
    chi2 = sum((tokens.count(i) - n * p) ** 2 / (n * p) for i, p in expected.items())
    assert chi2 < df + 6 * math.sqrt(2 * df) + 6, (chi2, df)  # beyond p < 1e-5 for these df


CASES = {  # name -> (temperature, top_k, top_p); with LOGITS
    "top_k": (1.0, 4, 1.0),
    "top_p": (1.0, 0, 0.7),
    "top_k_and_top_p": (0.8, 5, 0.6),
    "top_k_1": (1.0, 1, 1.0),
    "top_p_1": (1.3, 0, 1.0),
    "k_past_vocab": (1.0, 50, 1.0),
    "k_past_vocab_and_top_p": (1.0, 50, 0.9),
    "tiny_top_p": (1.0, 0, 1e-9),
    "top_k_minus_1": (0.5, -1, 0.95),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_drawn_distribution_is_exactly_the_filtered_one(monkeypatch, case):
    temperature, top_k, top_p = CASES[case]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = reference(LOGITS, temperature, top_k, top_p)
    assert_same_distribution(drawn_from(monkeypatch, LOGITS, params), expected)
    assert set(expected) == set(HAND[case])  # the reference itself, against sets worked out by hand


# The tokens of LOGITS by decreasing logit: 1, 6, 3, 9, 4, 0, 7, 5, 2, 8. At T=1 their cumulative probabilities
# are 0.304, 0.508, 0.644, 0.756, 0.857, 0.913, ...; at T=0.8 over the top 5: 0.398, 0.639, ...; at T=0.5:
# 0.510, 0.739, 0.843, 0.912, 0.968, ...
HAND = {
    "top_k": [1, 6, 3, 9],
    "top_p": [1, 6, 3, 9],  # 0.644 < 0.7 <= 0.756
    "top_k_and_top_p": [1, 6],  # 0.398 < 0.6 <= 0.639
    "top_k_1": [1],
    "top_p_1": list(range(10)),
    "k_past_vocab": list(range(10)),
    "k_past_vocab_and_top_p": [1, 6, 3, 9, 4, 0],  # 0.857 < 0.9 <= 0.913
    "tiny_top_p": [1],
    "top_k_minus_1": [1, 6, 3, 9, 4],  # 0.912 < 0.95 <= 0.968
}


@pytest.mark.parametrize("case", ["top_k", "top_p", "top_k_and_top_p", "top_k_1", "k_past_vocab_and_top_p"])
def test_sampled_frequencies_follow_the_renormalized_distribution(case):
    temperature, top_k, top_p = CASES[case]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    assert_frequencies_match(draws(LOGITS, params, 20_000), reference(LOGITS, temperature, top_k, top_p))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.35, [0]), (0.4 - 1e-3, [0]), (0.4 + 1e-3, [0, 1]), (0.65, [0, 1]), (0.75, [0, 1, 2]), (0.95, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_set_that_reaches_it(monkeypatch, top_p, kept):
    """Probabilities 0.4, 0.3, 0.2, 0.1 (shuffled over the ids): a token is kept while the mass before it is below
    top_p, so the kept mass is the first to reach top_p."""
    ids = [3, 0, 2, 1]  # ids[r] is the r-th most probable token
    logits = torch.full((4,), 0.0)
    logits[ids] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    ours = drawn_from(monkeypatch, logits, SamplingParams(top_p=top_p))
    assert set(ours) == {ids[r] for r in kept}


def test_top_k_keeps_every_token_tied_with_the_kth(monkeypatch):
    """Ties at the k-th logit are all kept (vLLM masks only logits strictly below the k-th), whatever their order."""
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5, 2.0])
    for _ in range(3):  # and the same set every time
        ours = drawn_from(monkeypatch, logits, SamplingParams(top_k=2))
        assert set(ours) == {1, 2, 3, 5}
        assert_same_distribution(ours, reference(logits, top_k=2))
    assert set(drawn_from(monkeypatch, logits, SamplingParams(top_k=1))) == {1}


def test_top_p_ties_at_the_boundary_are_broken_deterministically(monkeypatch):
    """Four tokens of 0.2 each after one of 0.2: top_p 0.5 needs three; which tied ones is the same on every call,
    the kept set has exactly the smallest size, and no dropped token is more probable than a kept one."""
    logits = torch.tensor([0.1, 0.2, 0.2, 0.2, 0.1, 0.2, 0.2]).log()
    sets = {frozenset(drawn_from(monkeypatch, logits, SamplingParams(top_p=0.5))) for _ in range(5)}
    assert len(sets) == 1
    (kept,) = sets
    assert len(kept) == 3 and kept <= {1, 2, 3, 5, 6}
    assert_same_distribution(drawn_from(monkeypatch, logits, SamplingParams(top_p=0.5)), dict.fromkeys(kept, 1 / 3))


def test_banned_tokens_stay_out_whatever_top_k_keeps(monkeypatch):
    """A token banned for this step (EOS before min_tokens) is -inf: a top_k past the vocab does not bring it back."""
    seen = []
    draw = torch.multinomial
    monkeypatch.setattr(
        torch, "multinomial", lambda probs, *a, **kw: seen.append(probs.clone()) or draw(probs, *a, **kw)
    )
    params = SamplingParams(top_k=50)
    sample(LOGITS[None].clone(), [params], [torch.Generator().manual_seed(0)], banned=[[1, 6]])
    (probs,) = seen
    assert probs[1] == 0 and probs[6] == 0 and int((probs > 0).sum()) == 8


class Allowed:
    """A structured-output constraint that allows a fixed set of token ids."""

    def __init__(self, ids: set[int], vocab: int) -> None:
        self.ids, self.vocab = ids, vocab

    def allows(self, token_id: int) -> bool:
        return token_id in self.ids

    def mask(self) -> torch.Tensor:
        return torch.tensor([i in self.ids for i in range(self.vocab)])


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (-1, 0.9), (2, 1.0)])
def test_a_constrained_top_p_or_top_k_row_draws_from_the_masked_filtered_row(monkeypatch, top_k, top_p):
    """Allowed 0 (p 0.45) and 2 (0.04), forbidden 1 (0.44) and the rest: top-p 0.9 of the masked row keeps only
    0 (0.45 / 0.49 >= 0.9), while the unmasked row's nucleus also holds 2. So a draw-then-check (meant for rows at a
    temperature alone) would sometimes return 2. With top-k 2 the unmasked top two are 0 and 1, the masked 0 and 2.
    Every distribution drawn from must be the masked, filtered one."""
    probs = torch.tensor([0.45, 0.44, 0.04] + [0.07 / 5] * 5)
    constraint = Allowed({0, 2}, len(probs))
    seen: list[torch.Tensor] = []
    draw = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **kw: seen.append(p.clone()) or draw(p, *a, **kw))
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(0)
    n = 200
    tokens = sample(
        probs.log().expand(n, -1).clone(), [params] * n, [g] * n, constraints=dict.fromkeys(range(n), constraint)
    )
    masked = probs.log().masked_fill(~constraint.mask(), float("-inf"))
    expected = reference(masked, 1.0, top_k, top_p)
    assert set(expected) == ({0} if top_p < 1 else {0, 2})  # the hand-worked sets above
    assert len(seen) == n
    for p in seen:
        p = p.double() / p.double().sum()
        assert_same_distribution({i: float(v) for i, v in enumerate(p) if v > 0}, expected)
    assert set(tokens) <= set(expected)
