"""Structured output in the engine: constrained outputs validate against their schema on the embedded model and on
a tiny random model, while unconstrained requests in the same batch keep exactly the tokens they get alone; a
preempted constrained request resumes its constraint where it was."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.structured.spec import StructuredOutputs

# No model emits this unconstrained: a valid output proves the constraint ran.
SCHEMA = {
    "type": "object",
    "properties": {
        "marker": {"enum": ["structured-ok"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flag": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["marker", "n", "flag", "name"],
    "additionalProperties": False,
}
PROMPTS = ["the quick brown fox", "hello world", "one two three", "a b c d e f"]
FREE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def constrained(**kw) -> SamplingParams:
    spec = StructuredOutputs("json", SCHEMA, disable_any_whitespace=True)
    return SamplingParams(**{"max_tokens": 80, "structured_outputs": spec} | kw)


@pytest.fixture(scope="module", params=["embedded", "tiny-random"])
def llm(request, tiny_gemma4):
    folder = None if request.param == "embedded" else str(tiny_gemma4)
    return LLM(folder, dtype="float32", kv_cache_memory="32MiB", max_model_len=512)


def check(out) -> dict:
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_mixed_batch_constrained_validate_and_unconstrained_are_unchanged(llm):
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, FREE)]
    mixed = [PROMPTS[0], "give me json", PROMPTS[1], PROMPTS[2], "json again", PROMPTS[3], "top-p json"]
    hot = [constrained(temperature=1.0, seed=7), constrained(temperature=1.0, top_p=0.9, top_k=20, seed=3)]
    params = [FREE, constrained(temperature=0), FREE, FREE, hot[0], FREE, hot[1]]  # greedy, temperature, filtered
    outs = [o.outputs[0] for o in llm.generate(mixed, params)]
    assert [outs[i].token_ids for i in (0, 2, 3, 5)] == alone
    for i in (1, 4, 6):
        check(outs[i])


def test_json_object_choice_and_regex(llm):
    kinds = [StructuredOutputs("json_object", disable_any_whitespace=True), StructuredOutputs("choice", ["yes", "no"]),
             StructuredOutputs("regex", "[0-9]{3}-[a-c]{2}")]  # fmt: skip
    outs = llm.generate(
        ["x y z"] * 3, [SamplingParams(max_tokens=60, temperature=0, structured_outputs=k) for k in kinds]
    )
    obj, choice, regex = (o.outputs[0] for o in outs)
    if obj.finish_reason == "length":  # a random model may write one endless number: cut, as vLLM cuts it
        assert llm.engine.config.model != str(DEFAULT_MODEL_DIR) and obj.text.startswith("{")
    else:
        assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert (
        len(regex.text) == 6 and regex.text[:3].isdigit() and regex.text[3] == "-" and set(regex.text[4:]) <= set("abc")
    )


def test_a_preempted_constrained_request_resumes_its_constraint(llm):
    """Preemption recomputes the request from its tokens, output included: the matcher (which consumed exactly the
    output) must continue where it was, giving the tokens of an uninterrupted run."""
    want = llm.generate("give me json", constrained(temperature=0))[0].outputs[0]
    engine = llm.engine
    req = engine.add_request("give me json", constrained(temperature=0))
    while len(req.output_token_ids) < 6 and not req.status.finished:
        engine.step()
    assert not req.status.finished, (req.status, req.error)
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)
    while engine.has_unfinished():
        engine.step()
    assert req.num_preemptions == 1
    assert req.output_token_ids == want.token_ids
    check(want)


def test_max_tokens_cuts_a_constrained_output_and_logprobs_stay_raw(llm):
    """A constraint cut by max_tokens finishes with "length" and a prefix of valid JSON (as vLLM); logprobs are the
    model's own distribution, not the masked one (the sampled token's logprob is what the model gave it)."""
    free = llm.generate("give me json", SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0].outputs[0]
    cut = llm.generate("give me json", constrained(temperature=0, logprobs=1, max_tokens=4))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4 and cut.text.startswith("{")
    assert cut.logprobs[0].top == free.logprobs[0].top  # the first step's raw distribution, mask or not
    assert cut.logprobs[0].logprob <= free.logprobs[0].top[0][1]
