"""Tool calling on /v1/chat/completions, OpenAI's fields with vLLM's rules.

    tool_choice          what constrains the output                      the answer
    "none"               nothing (the template still sees the tools)     content
    "required"           JSON: [{"name": one of the tools, "parameters": that tool's schema}, ...]
                                                                         tool_calls, finish_reason "tool_calls"
    {"function": f}      JSON: f's parameters schema                     one call of f, finish_reason "stop"
    "auto" (the default  nothing; a tool-call parser (--tool-call-parser) finds calls in the text afterwards
    when tools are given) needs --enable-auto-tool-choice, as in vLLM    content and/or tool_calls

The structured-output path enforces the schemas, so required and named calls always parse and their arguments
validate. Assistant messages that carry `tool_calls` reach the chat template with their arguments as objects
(the shape Hugging Face templates expect), `tool` messages with their `tool_call_id`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridkv.structured.spec import StructuredOutputs

_STRICT = ConfigDict(strict=True)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # the schema is always enforced when a call is required or named


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(BaseModel):
    """A tool call in an assistant message the client sends back."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def resolve_choice(tools: list[Tool] | None, choice: ToolChoice | None, auto_enabled: bool) -> ToolChoice | None:
    """The effective tool_choice (vLLM's rules); a ValueError naming what to change. None: no tools."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    choice = "auto" if choice is None else choice
    if choice == "auto" and not auto_enabled:
        raise ValueError(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser; '
            'or send tool_choice "required" or a named function'
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
    return choice


def constraint(tools: list[Tool], choice: ToolChoice, parallel: bool) -> StructuredOutputs | None:
    """The output constraint `choice` implies (None for none and auto)."""
    if isinstance(choice, NamedToolChoice):
        (tool,) = [t for t in tools if t.function.name == choice.function.name]
        return StructuredOutputs("json", tool.function.parameters, disable_any_whitespace=True, field="tools")
    if choice != "required":
        return None
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"enum": [t.function.name]}, "parameters": t.function.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema = {"type": "array", "minItems": 1, "items": one_call} | ({} if parallel else {"maxItems": 1})
    return StructuredOutputs("json", schema, disable_any_whitespace=True, field="tools")


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def forced_calls(text: str, choice: ToolChoice) -> list[dict[str, Any]]:
    """The tool calls in a constrained output (required or named); [] when it was cut short (max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, value)]
    return [_call(c["name"], c["parameters"]) for c in value]


# ---- tool-call parsers for tool_choice "auto" (vLLM's --tool-call-parser names) --------------------------------
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen templates: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
            calls.append(_call(obj["name"], obj.get("arguments", {})))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # a malformed call: the text goes back as content, as vLLM's parser does
    content = _HERMES.sub("", text).strip() if calls else text
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3 JSON calls: the output is `{"name": ..., "parameters": {...}}` (several joined by ';')."""
    stripped = text.strip().removeprefix("<|python_tag|>")
    if not stripped.startswith("{"):
        return text, []
    calls = []
    for part in stripped.split(";"):
        try:
            obj = json.loads(part)
            calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
    return None, calls


TOOL_PARSERS: dict[str, Callable[[str], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: tool-call arguments as objects (they arrive as JSON text)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c["function"])
                with contextlib.suppress(json.JSONDecodeError):  # else a template gets what the client sent
                    f["arguments"] = json.loads(f["arguments"])
                calls.append(c | {"function": f})
            m["tool_calls"] = calls
        out.append(m)
    return out


def answer(
    text: str, finish_reason: str | None, choice: ToolChoice | None, parser: str | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message for an output `text` under `choice`, and its finish reason."""
    if choice is None or choice == "none":
        return {"role": "assistant", "content": text}, finish_reason
    if choice == "auto":
        content, calls = TOOL_PARSERS[parser or "hermes"](text)
    else:
        calls = forced_calls(text, choice)
        content = None if calls else text
    message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
    if calls and finish_reason == "stop" and not isinstance(choice, NamedToolChoice):
        finish_reason = "tool_calls"
    return message, finish_reason
