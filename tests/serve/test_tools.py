"""Tool calls on /v1/chat/completions (`serve/tools.py`) through the openai client, against the embedded model with
a Hermes/Qwen-style template that describes tools and renders calls and tool results: required and named calls
come back valid against their schemas (the structured-output path enforces them), a round trip with the call and
its result sent back is answered, the rendered ids equal transformers' `apply_chat_template(tools=...)`, and
tool_choice "auto" follows vLLM's rule (a 400 unless the server has a parser)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import jsonschema
import openai
import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.serve.tools import TOOL_PARSERS
from tests.procs import Process

TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather <&> forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        shutil.copy(DEFAULT_MODEL_DIR / f, folder / f)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(folder):
    p = Process("serve", str(folder), "--threads", "1", "--kv-cache-memory", "16MiB", "--max-model-len", "1024",
                "--served-model-name", "m")  # fmt: skip
    yield p
    p.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_call_round_trip_with_the_openai_client(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                                       parallel_tool_calls=False)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False: one call at most
    call = choice.message.tool_calls[0]
    sent_back = ASK + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]  # fmt: skip
    again = client.chat.completions.create(model="m", messages=sent_back, tools=TOOLS, tool_choice="none",
                                           max_tokens=6)  # fmt: skip
    assert again.usage.completion_tokens == 6 and again.choices[0].message.tool_calls is None


def test_several_required_calls_all_validate(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                       n=3, temperature=1.0, seed=3)  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
    check_calls([call])


def test_a_streamed_required_call_arrives_whole(client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=96, parallel_tool_calls=False, stream=True)  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and deltas[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


def test_rendered_ids_with_tools_and_calls_equal_transformers(server, folder):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    args = json.dumps({"city": "Lima", "unit": "c", "days": 2})
    chat = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    ours = httpx.post(f"{server.url}/v1/chat/completions/render", json={"messages": chat, "tools": TOOLS}, timeout=30)
    assert ours.status_code == 200, ours.text
    # transformers' templates take arguments as objects (what we hand our templates, from the JSON text sent)
    hf_chat = [dict(m) for m in chat]
    hf_chat[1]["tool_calls"] = [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.loads(args)}}]  # fmt: skip
    want = tok.apply_chat_template(hf_chat, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ours.json()["token_ids"] == want


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"tools": TOOLS}, "--enable-auto-tool-choice"),  # no tool_choice with tools: "auto", as in vLLM
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "give one"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_tool_requests_vllm_refuses_are_400s_saying_why(server, extra, says):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4} | extra, timeout=30)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_tool_call_parsers_for_auto():
    hermes = TOOL_PARSERS["hermes"]
    content, calls = hermes('Let me look.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert content == "Let me look." and [c["function"] for c in calls] == [
        {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    ]
    assert hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert hermes("just text") == ("just text", [])
    llama = TOOL_PARSERS["llama3_json"]
    content, calls = llama('{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and calls[0]["function"]["arguments"] == '{"zone": "CET"}'
    assert llama("The time is noon.") == ("The time is noon.", [])


def test_auto_with_a_parser_answers_text_or_calls(folder):
    """With --enable-auto-tool-choice --tool-call-parser hermes, "auto" is served: the output is free text, and
    the parser turns `<tool_call>` blocks into tool_calls (the tiny model writes none: content comes back)."""
    p = Process("serve", str(folder), "--threads", "1", "--kv-cache-memory", "16MiB", "--max-model-len", "1024",
                "--served-model-name", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
    try:
        body = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] and "tool_calls" not in message
    finally:
        p.stop()
    bad = subprocess.run(["hybridkv", "serve", "--enable-auto-tool-choice"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--tool-call-parser" in bad.stderr
