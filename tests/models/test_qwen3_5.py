"""Qwen3.5 (Gated DeltaNet + gated full attention) in float32: parity with transformers over a 150-token prompt
and 64 greedy decode steps, and the same bits for a prompt whole or chunked at multiples of 64, and for a request
alone or batched with another. As the engine does, the last prompt token always runs alone (the recurrent step)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridkv.models.reference_attention import ReferenceAttention
from hybridkv.models.reference_states import ReferenceStates
from hybridkv.models.registry import load_model
from tests.models.tiny_qwen3_5 import build, build_multimodal
from tests.models.util import assert_parity, hf_greedy, prompt

transformers = pytest.importorskip("transformers")

PROMPT, STEPS = 150, 64


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("qwen3_5")
    hf = build(path)
    return hf, load_model(path, dtype="float32")


class Sequence:
    """One request driven through the model with the reference attention and states."""

    def __init__(self, model) -> None:
        self.model, self.attn = model, ReferenceAttention.for_model(model)
        self.states = ReferenceStates(model.state_shapes())

    @torch.no_grad()
    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Hidden states [n, hidden] of tokens at positions start .. start + n - 1."""
        positions = torch.arange(start, start + len(ids))
        return self.model(ids, positions, self.attn, self.states.for_tokens(len(ids)))


@torch.no_grad()
def generate(model, ids: torch.Tensor, cuts: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """Prefill in calls ending at `cuts` (the last one at len(ids)), then `steps` greedy one-token steps. Returns
    the tokens and the logits [1 + steps, vocab]: the prompt's last position, then every decode step."""
    seq, start = Sequence(model), 0
    for end in cuts:
        hidden = seq.run(ids[start:end], start)
        start = end
    logits = [model.compute_logits(hidden[-1:])[0]]
    tokens = [int(logits[-1].argmax())]
    for t in range(steps):
        logits.append(model.compute_logits(seq.run(torch.tensor(tokens[-1:]), len(ids) + t))[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def test_layout(models):
    _, model = models
    assert model.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert model.state_shapes() == {i: ((3, 192), (4, 16, 32)) for i in (0, 1, 2, 4, 5, 6)}
    assert model.layer_windows == [None] * 8 and model.kv_sharing == {}
    assert model.lm_head is None  # tied embeddings


def test_prompt_logits_match_transformers(models):
    hf, model = models
    ids = prompt(PROMPT)
    hidden = Sequence(model).run(ids, 0)  # every position, in one chunked call
    assert_parity(model.compute_logits(hidden), hf(input_ids=ids[None]).logits[0])


def test_greedy_decode_matches_transformers(models):
    hf, model = models
    ids = prompt(PROMPT)
    theirs, their_logits = hf_greedy(hf, ids, steps=STEPS + 1)  # its chunked prompt, then its recurrent path
    ours, our_logits = generate(model, ids, [PROMPT - 1, PROMPT])
    assert_parity(our_logits, their_logits)
    assert ours == theirs


@pytest.mark.parametrize("cuts", [[64, 128, 149, 150], [128, 149, 150]])
def test_chunked_prefill_gives_the_same_bits(models, cuts):
    _, model = models
    ids = prompt(PROMPT)
    tokens, logits = generate(model, ids, [149, 150])
    chunked_tokens, chunked_logits = generate(model, ids, cuts)
    assert torch.equal(chunked_logits[0], logits[0])  # the prompt's last position
    assert torch.equal(chunked_logits, logits)  # and every decode step
    assert chunked_tokens == tokens


class Batch:
    """Several sequences in one forward pass: per-request attention and states, flat spans."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs, self.spans = seqs, []
        self.in_place = ()

    def attn(self, layer, q, kv, scale):
        return torch.cat([s.attn(layer, q[a:b], kv[a:b], scale) for s, (a, b) in zip(self.seqs, self.spans)])

    def state(self, layer, r):
        return self.seqs[r].states.state(layer, 0)

    @torch.no_grad()
    def run(self, model, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        lengths = [len(ids) for ids, _ in parts]
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        self.spans = list(itertools.pairwise(bounds))
        ids = torch.cat([ids for ids, _ in parts])
        positions = torch.cat([torch.arange(start, start + len(i)) for i, start in parts])
        return model(ids, positions, self.attn, self)


def test_batched_requests_give_the_same_bits_as_alone(models):
    _, model = models
    a, b = prompt(101, seed=2), prompt(75, seed=3)
    steps = [  # (tokens of a, start), (tokens of b, start) per forward pass
        ((a[:64], 0), (b[:64], 0)),
        ((a[64:100], 64), (b[64:74], 64)),
        ((a[100:101], 100), (b[74:75], 74)),  # two one-token calls
        ((torch.tensor([5]), 101), (torch.tensor([6]), 75)),
    ]
    batch = Batch([Sequence(model), Sequence(model)])
    alone = [Sequence(model), Sequence(model)]
    for step in steps:
        hidden = batch.run(model, list(step))
        n = len(step[0][0])
        assert torch.equal(hidden[:n], alone[0].run(*step[0]))
        assert torch.equal(hidden[n:], alone[1].run(*step[1]))
    for s, ref in zip(batch.seqs, alone):
        for layer in model.state_shapes():
            assert all(torch.equal(x, y) for x, y in zip(s.states.state(layer, 0), ref.states.state(layer, 0)))


def test_checkpoint_names_of_the_multimodal_model(models):
    _, model = models
    assert model.checkpoint_name("model.language_model.layers.0.linear_attn.A_log") == "layers.0.linear_attn.A_log"
    assert model.checkpoint_name("model.layers.3.self_attn.q_norm.weight") == "layers.3.self_attn.q_norm.weight"
    for skipped in ("model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight", "lm_head.weight"):
        assert model.checkpoint_name(skipped) is None


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    hf = build_multimodal(tmp_path)
    model = load_model(tmp_path, dtype="float32")  # model_type qwen3_5: text_config, model.language_model.*
    ids = prompt(PROMPT)
    with torch.no_grad():
        assert_parity(model.compute_logits(Sequence(model).run(ids, 0)), hf(input_ids=ids[None]).logits[0])
