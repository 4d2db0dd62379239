"""Nemotron-H (4 Mamba2 + 2 attention + 2 MLP layers) against transformers in float32, and against itself
bitwise: a prompt whole or cut at multiples of the chunk size, and a request alone or batched with another.

"Whole" is the engine's whole-prompt mode: [0, L - 1) in one call, then the last prompt token alone (the engine
always runs it alone); a literal one-call [0, L) equals it within float32 rounding (the chunk scan and the
recurrence both clamp dt to time_step_limit, as transformers >= 5.25 does).
"""

from itertools import pairwise

import pytest
import torch

from hybridkv.models.nemotron_h import NemotronHForCausalLM
from hybridkv.models.reference_attention import ReferenceAttention
from hybridkv.models.reference_states import ReferenceStates
from hybridkv.models.registry import load_model
from tests.models.tiny_nemotron_h import NEMOTRON_H_TINY, build_nemotron_h
from tests.models.util import assert_parity, hf_greedy, prompt

pytest.importorskip("transformers")

L, STEPS = 150, 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    hf = build_nemotron_h(path)
    return hf, load_model(path, dtype="float32")


class Sequence:
    """One request's attention KV and recurrent states, kept across forward passes."""

    def __init__(self, model: NemotronHForCausalLM) -> None:
        self.attn = ReferenceAttention.for_model(model)
        self.states = ReferenceStates(model.state_shapes())


class Batch:
    """AttentionFn + RecurrentStates over several requests packed back to back, each request served by its own
    `Sequence`: what the engine's paged attention and state pool promise, in their simplest form."""

    def __init__(self, seqs: list[Sequence], lengths: list[int]) -> None:
        ends = torch.tensor(lengths).cumsum(0).tolist()
        self.seqs, self.spans = seqs, list(zip([0, *ends[:-1]], ends))
        self.in_place = ()

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.cat([s.attn(layer, q[a:b], kv[a:b], scale) for s, (a, b) in zip(self.seqs, self.spans)])

    def state(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seqs[r].states.state(layer, 0)


@torch.no_grad()
def step(model: NemotronHForCausalLM, seqs: list[Sequence], pieces: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """One forward pass over requests (token ids, first position): the logits at each request's last token."""
    batch = Batch(seqs, [len(ids) for ids, _ in pieces])
    ids = torch.cat([ids for ids, _ in pieces])
    positions = torch.cat([torch.arange(p, p + len(ids)) for ids, p in pieces])
    hidden = model(ids, positions, batch, batch)
    return model.compute_logits(hidden[[b - 1 for _, b in batch.spans]])


def run(model: NemotronHForCausalLM, ids: torch.Tensor, cuts: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The prompt in the pieces [cuts[i], cuts[i+1]), then `steps` - 1 greedy decode steps: the greedy tokens and
    the logits that chose them ([steps, vocab]; row 0 at the prompt's last token)."""
    seq = Sequence(model)
    for t0, t1 in pairwise(cuts):
        logits = step(model, [seq], [(ids[t0:t1], t0)])[0]
    tokens, rows = [int(logits.argmax())], [logits]
    for pos in range(len(ids), len(ids) + steps - 1):
        rows.append(step(model, [seq], [(torch.tensor(tokens[-1:]), pos)])[0])
        tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


def test_layout(models):
    _, model = models
    assert model.kinds == ["linear_attention", "full_attention", "linear_attention", "mlp"] * 2
    assert model.state_shapes() == {i: ((3, 8 * 16 + 2 * 2 * 16), (8, 16, 16)) for i in (0, 2, 4, 6)}
    assert model.layer_windows == [None] * 8 and model.kv_sharing == {}


def test_parity_prompt_then_greedy_decode(models):
    """transformers with its cache (chunk path for the prompt, one-token path for decode) vs our prompt in one
    call and our decode steps: logits at the prompt's last token and at every decode step, and the tokens."""
    hf, model = models
    ids = prompt(L)
    theirs, their_logits = hf_greedy(hf, ids, steps=STEPS + 1)
    ours, our_logits = run(model, ids, [0, L], STEPS + 1)
    assert_parity(our_logits, their_logits)
    assert ours == theirs


@pytest.mark.parametrize("cuts", [[0, 64, 128, 149, 150], [0, 128, 149, 150], [0, 32, 64, 96, 128, 149, 150]])
def test_chunked_prefill_is_bitwise(models, cuts):
    _, model = models
    ids = prompt(L)
    whole_tokens, whole = run(model, ids, [0, L - 1, L], STEPS)
    tokens, logits = run(model, ids, cuts, STEPS)
    assert torch.equal(logits[0], whole[0])  # the prompt's last position
    assert torch.equal(logits, whole) and tokens == whole_tokens  # and every decode step


def test_batch_is_bitwise(models):
    """Two requests sharing every forward pass (prefill pieces of different lengths, a one-token tail beside a
    multi-token piece, joint decode) give the bits each gives alone."""
    _, model = models
    a, b = prompt(L, seed=1), prompt(100, seed=2)
    plan = [  # (piece of a, piece of b) per forward pass, as (t0, t1); b's second piece starts off the grid
        ((0, 128), (0, 80)),
        ((128, 149), (80, 99)),
        ((149, 150), (99, 100)),
    ]
    alone = [Sequence(model), Sequence(model)]
    joint = [Sequence(model), Sequence(model)]
    for pa, pb in plan:
        apart = [step(model, [alone[0]], [(a[slice(*pa)], pa[0])]), step(model, [alone[1]], [(b[slice(*pb)], pb[0])])]
        together = step(model, joint, [(a[slice(*pa)], pa[0]), (b[slice(*pb)], pb[0])])
        assert torch.equal(together, torch.cat(apart))
    next_a, next_b = int(together[0].argmax()), int(together[1].argmax())
    for i in range(8):
        pieces = [(torch.tensor([next_a]), L + i), (torch.tensor([next_b]), 100 + i)]
        apart = torch.cat([step(model, [alone[r]], [pieces[r]]) for r in range(2)])
        together = step(model, joint, pieces)
        assert torch.equal(together, apart)
        next_a, next_b = int(together[0].argmax()), int(together[1].argmax())


def test_config_from_pattern_and_moe_refused():
    cfg = {k: v for k, v in NEMOTRON_H_TINY.items() if k != "chunk_size"} | dict(mamba_chunk_size=16)
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    assert model.kinds[:4] == ["linear_attention", "full_attention", "linear_attention", "mlp"]
    assert model.layers[0].mixer.chunk == 16
    with pytest.raises(ValueError, match="MoE layers are not supported yet"):
        NemotronHForCausalLM(dict(cfg, hybrid_override_pattern="ME*"))


def test_time_step_limit_in_either_json_spelling_and_a_bad_one_refused():
    from hybridkv.models.nemotron_h import _config_float

    assert _config_float({"__float__": "Infinity"}) == float("inf") and _config_float(0) == 0.0
    with pytest.raises(ValueError, match="time_step_limit"):
        _config_float({"low": 1})
