"""Structured output under prefill/decode disaggregation: the decoder receives the prompt's KV, not the prefill's
sampled token, so it starts the request's matcher from the start of the output and samples every token itself;
through the proxy a constrained request gives the single instance's output, which validates, while KV moved."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hybridkv import LLM, SamplingParams, StructuredOutputs
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.pd_util import HELDOUT, assert_clean, complete, fronted, server, transfers

SCHEMA = {
    "type": "object",
    "properties": {"marker": {"enum": ["structured-ok"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["marker", "n"],
    "additionalProperties": False,
}
CONFIG = ["--structured-outputs-config", '{"disable_any_whitespace": true}']


@pytest.fixture(scope="module")
def pd():
    p, d, x = fronted(*(server(str(DEFAULT_MODEL_DIR), "per-layer", *CONFIG, wait=False) for _ in range(2)))
    yield p, d, x
    for proc in (x, p, d):
        proc.stop()


def test_constrained_requests_through_the_proxy_equal_one_instance(pd):
    p, d, x = pd
    prompts = [it["prompt"] for it in HELDOUT[:3]]
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}}
    with transfers(d, at_least=3):
        texts = [complete(x.url, q, max_tokens=40, response_format=fmt)["choices"][0]["text"] for q in prompts]
    llm = LLM(
        None, kv_cache_memory="32MiB", max_model_len=512, structured_outputs_config={"disable_any_whitespace": True}
    )
    spec = StructuredOutputs("json", SCHEMA)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, structured_outputs=spec)
    assert texts == [o.outputs[0].text for o in llm.generate(prompts, params)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert_clean(p, d)
