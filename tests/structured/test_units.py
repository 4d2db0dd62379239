"""Structured output, piece by piece: specs, the compiler and its matchers on the embedded tokenizer, the mask in
the sampler (only constrained rows change), and the request fields that carry a constraint."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.runner.sampler import TOP_CANDIDATES, sample
from hybridkv.serve.chat_protocol import ChatRequest
from hybridkv.serve.protocol import APIError, CompletionRequest, parse
from hybridkv.structured.grammar import GrammarCompiler, unpack
from hybridkv.structured.spec import StructuredOutputs
from tests.runner.test_sampler_filters import LOGITS, assert_frequencies_match, reference

EOS = (1, 202, 427)  # the embedded model's
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(DEFAULT_MODEL_DIR, 428, EOS)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)


def allowed_text(compiler: GrammarCompiler, tok: Tokenizer, matcher) -> set[str]:
    mask = matcher.mask()
    assert all(matcher.allows(i) == bool(mask[i]) for i in range(mask.numel()))  # the cheap check agrees
    return {tok.token_text(i) for i in mask.nonzero().flatten().tolist()}


def test_specs_are_normalized_and_bad_ones_name_their_field():
    a = StructuredOutputs("json", {"b": 1, "type": "object"})
    b = StructuredOutputs("json", '{"type": "object", "b": 1}')
    assert a == b and hash(a) == hash(b)  # one cache entry for equal schemas however they were written
    assert StructuredOutputs("choice", ["x", "y"]).spec == '["x","y"]'
    assert StructuredOutputs.of(choice=["x", "y"]) == StructuredOutputs("choice", ["x", "y"])  # vLLM's spelling
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs.of(regex="a", choice=["a"])
    for kind, spec, words in [("yaml", "", "unknown kind"), ("choice", [], "non-empty"), ("json", "{", "not valid"),
                              ("json", [1], "must be an object"), ("regex", "", "non-empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=words) as e:
            StructuredOutputs(kind, spec, field="guided_x")
        assert str(e.value).startswith("guided_x")


def test_matcher_masks_advances_and_finishes(compiler, tok):
    m = compiler.matcher(StructuredOutputs("json", SCHEMA, disable_any_whitespace=True))
    assert allowed_text(compiler, tok, m) == {"{"}
    for t in tok.encode('{"ok":tru'):
        if t != 2:  # BOS
            assert m.accept(t)
    assert allowed_text(compiler, tok, m) == {"e"}
    assert not m.finished
    assert m.accept(tok.encode("e")[-1]) and m.accept(tok.encode("}")[-1])
    assert m.finished and allowed_text(compiler, tok, m) == {tok.token_text(i) for i in EOS}
    fresh = compiler.matcher(StructuredOutputs("json", SCHEMA, disable_any_whitespace=True))
    assert allowed_text(compiler, tok, fresh) == {"{"}  # the cached template was copied, never advanced
    assert not fresh.accept(tok.encode("x")[-1])  # a token the constraint forbids


def test_bad_constraints_fail_to_compile_naming_the_field(compiler):
    for spec in [StructuredOutputs("json", {"type": "nonsense"}, field="response_format.json_schema.schema"),
                 StructuredOutputs("json", {"type": "string", "pattern": "(("}, field="guided_json"),
                 StructuredOutputs("regex", "((", field="guided_regex"),
                 StructuredOutputs("grammar", "start: foo", field="structured_outputs.grammar")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            compiler.compile(spec)
        assert str(e.value).startswith(spec.field), e.value


def test_unpack_bit_order():
    words = torch.tensor([0b101, -(1 << 31)], dtype=torch.int32)  # tokens 0, 2 and 63 (-(1 << 31): bit 31 only)
    assert unpack(words, 64).nonzero().flatten().tolist() == [0, 2, 63]
    assert unpack(words, 40).nonzero().flatten().tolist() == [0, 2]  # bits past the vocab are dropped
    assert unpack(torch.tensor([-1, -1], dtype=torch.int32), 40).all()


class Allowed:
    """A constraint allowing a fixed set of tokens; counts how often its full mask was built."""

    def __init__(self, vocab: int, tokens: list[int]) -> None:
        self._mask = torch.zeros(vocab, dtype=torch.bool)
        self._mask[tokens] = True
        self.masks = 0

    def allows(self, token_id: int) -> bool:
        return bool(self._mask[token_id])

    def mask(self) -> torch.Tensor:
        self.masks += 1
        return self._mask.clone()


def test_mask_changes_constrained_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    raw = logits.clone()
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)
    params = [greedy, greedy, hot, hot]
    gens = lambda: [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]  # noqa: E731
    free = sample(logits, params, gens())
    constraints = {1: Allowed(50, [7]), 3: Allowed(50, [3, 4])}  # row 1 may only pick 7, row 3 only 3 or 4
    out = sample(logits, params, gens(), constraints=constraints)
    assert torch.equal(logits, raw)  # the caller's logits stay raw (logprobs read them)
    assert out[1] == 7 and out[3] in (3, 4)
    assert out[0] == free[0] and out[2] == free[2]  # unconstrained rows: same tokens, same generator draws


def test_a_mask_that_leaves_nothing_fails_that_row_only():
    logits = torch.randn(2, 10)
    errors: dict[int, str] = {}
    params = [SamplingParams(temperature=0)] * 2
    only_eos = {1: Allowed(10, [1])}  # only EOS (1), which min_tokens bans
    out = sample(logits, params, [None, None], banned=[(), (1,)], errors=errors, constraints=only_eos)
    assert list(errors) == [1] and "structured-output" in errors[1]
    assert out[0] == int(logits[0].argmax())


def test_greedy_rows_build_a_mask_only_when_their_best_tokens_do_not_settle_it():
    """The fast paths: an allowed argmax is taken as it is; else the best allowed token among the top candidates;
    else the mask. Over random rows and constraints, the token equals masking first, and each path ran."""
    gen = torch.Generator().manual_seed(3)
    greedy = [SamplingParams(temperature=0)]
    paths = Counter()
    for _ in range(300):
        row = torch.randn(1, 64, generator=gen)
        tokens = torch.randperm(64, generator=gen)[: int(torch.randint(1, 40, (1,), generator=gen))].tolist()
        constraint = Allowed(64, tokens)
        masked = row[0].masked_fill(~constraint.mask(), float("-inf"))
        constraint.masks = 0
        assert sample(row, greedy, [None], constraints={0: constraint}) == [int(masked.argmax())]
        rank = row[0].argsort(descending=True).tolist().index(int(masked.argmax()))
        path = "argmax" if rank == 0 else "candidates" if rank < TOP_CANDIDATES - 1 else "mask"
        assert constraint.masks == (path == "mask"), (rank, constraint.masks)
        paths[path] += 1
    assert min(paths.values()) > 20, paths  # every path ran


def test_ties_among_the_best_tokens_fall_back_to_the_mask():
    """Equal logits: the masked argmax is the lowest allowed index, which the candidates' order may not show."""
    row = torch.zeros(1, 16)
    row[0, 9] = 2.0  # the argmax, forbidden
    row[0, [5, 3]] = 1.0  # both allowed and tied: the first maximum is 3, whatever order topk lists them in
    constraint = Allowed(16, [3, 5])
    assert sample(row, [SamplingParams(temperature=0)], [None], constraints={0: constraint}) == [3]
    assert constraint.masks == 1
    row[0, 5] = 0.5  # now 3 is the single next best: settled without the mask
    constraint.masks = 0
    assert sample(row, [SamplingParams(temperature=0)], [None], constraints={0: constraint}) == [3]
    assert constraint.masks == 0


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_rows_draw_from_the_masked_distribution(top_k):
    """At a temperature alone a row draws from the whole row and builds the mask only when the draw is forbidden;
    with top-k it is masked first (top-k must keep the best *allowed* tokens). Either way the draws follow the
    masked distribution (chi-square against it, computed independently)."""
    allowed = [0, 2, 3, 5, 9]  # token 1, the most probable, is forbidden: many first draws are rejected
    n = 4000
    params = SamplingParams(temperature=0.7, top_k=top_k, seed=1)
    constraint = Allowed(10, allowed)
    gen = torch.Generator().manual_seed(5)
    rows = LOGITS.expand(n, -1).clone()
    tokens = sample(rows, [params] * n, [gen] * n, constraints=dict.fromkeys(range(n), constraint))
    expected = reference(LOGITS[allowed], temperature=0.7, top_k=top_k)  # over the allowed tokens alone
    assert_frequencies_match(tokens, {allowed[j]: q for j, q in expected.items()})
    if top_k:
        assert constraint.masks == n  # every row
    else:
        assert 0.2 * n < constraint.masks < 0.8 * n  # the rejected draws only: both paths ran


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}


@pytest.mark.parametrize(
    "fields, kind",
    [({"response_format": {"type": "text"}}, None),
     ({"response_format": {"type": "json_object"}}, "json_object"),
     ({"response_format": SCHEMA_FORMAT}, "json"),
     ({"guided_json": SCHEMA}, "json"),
     ({"guided_json": json.dumps(SCHEMA)}, "json"),
     ({"guided_choice": ["a", "b"]}, "choice"),
     ({"guided_regex": "[0-9]+"}, "regex"),
     ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json"),
     ({"structured_outputs": {"json_object": True}}, "json_object"),
     ({"structured_outputs": {"choice": ["a"]}}, "choice"),
     ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar")],
)  # fmt: skip
def test_request_fields_carry_the_constraint(fields, kind):
    for model, body in [
        (CompletionRequest, {"prompt": "x"}),
        (ChatRequest, {"messages": [{"role": "u", "content": "x"}]}),
    ]:
        spec = parse(model, body | fields).sampling_params(16).structured_outputs
        assert (spec.kind if spec else None) == kind
        if spec is not None and kind == "json":
            assert json.loads(spec.spec) == SCHEMA


@pytest.mark.parametrize(
    "fields, param",
    [({"response_format": {"type": "structural_tag"}}, "response_format"),
     ({"response_format": {"type": "json_schema"}}, "response_format"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
     ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format"),
     ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
     ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
     ({"guided_choice": []}, "guided_choice"),
     ({"guided_json": "{not json"}, "guided_json"),
     ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend")],
)  # fmt: skip
def test_unsupported_or_conflicting_constraints_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"prompt": "x"} | fields).sampling_params(16)
    assert e.value.status == 400 and param in e.value.message, e.value.message
