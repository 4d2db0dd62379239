"""Structured output end to end: a real `hybridkv serve` (the embedded model) answers response_format json_schema /
json_object, vLLM's guided_json and structured_outputs, streamed or not, through the OpenAI client and plain HTTP;
outputs validate against a schema no unconstrained model writes; a bad schema is a 400 naming the field, and
constrained requests never change the unconstrained ones served beside them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.procs import Process

SCHEMA = {
    "type": "object",
    "properties": {
        "marker": {"enum": ["structured-ok"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flag": {"type": "boolean"},
    },
    "required": ["marker", "n", "flag"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "marked", "schema": SCHEMA, "strict": True}}
FREE = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for p in ("the quick brown fox", "hello world", "one two three")]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    engine = ["--threads", "1", "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
    p = Process("serve", *engine, "--structured-outputs-config", '{"disable_any_whitespace": true}')
    yield p
    p.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_chat_response_format_json_schema_streamed_and_not(client):
    messages = [{"role": "user", "content": "Describe a cat."}]
    kw = dict(model="default-model", messages=messages, temperature=0, max_tokens=80, response_format=FORMAT)
    reply = client.chat.completions.create(**kw)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    valid(text)
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def test_json_object_guided_json_and_structured_outputs(client, server):
    obj = client.completions.create(model="default-model", prompt="Tell me a story", max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
    guided = client.completions.create(model="default-model", prompt="A record:", max_tokens=80, temperature=0.8,
                                       seed=3, extra_body={"guided_json": SCHEMA})  # fmt: skip
    valid(guided.choices[0].text)
    body = {"prompt": "Pick:", "max_tokens": 10, "structured_outputs": {"choice": ["left", "right"]}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("left", "right"), r.text
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True, "seed": 1}, timeout=60) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and "[DONE]" not in x]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) in ("left", "right")


def texts(url: str, bodies: list[dict]) -> list[str]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=60), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["text"] for r in replies]


def test_bad_schemas_are_400s_and_constrained_neighbours_change_nothing(server):
    alone = texts(server.url, FREE)
    for fields, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"guided_json": {"type": "string", "pattern": "(("}}, "guided_json"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ]:  # fmt: skip
        r = httpx.post(f"{server.url}/v1/completions", json=FREE[0] | fields, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    constrained = [{"prompt": "json:", "max_tokens": 80, "temperature": 0, "response_format": FORMAT}] * 2
    mixed = texts(server.url, [*FREE, *constrained])
    assert mixed[: len(FREE)] == alone
    for text in mixed[len(FREE) :]:
        valid(text)
