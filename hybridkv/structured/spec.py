"""StructuredOutputs: what a request's output must match (vLLM's StructuredOutputsParams), and the registry of kinds
that turns each into an llguidance grammar."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from hybridkv.structured.limits import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, json_depth


def _json_value(value: Any, what: str) -> Any:
    """A spec given as JSON text, parsed (a spec given as a value passes through)."""
    if not isinstance(value, str):
        return value
    if len(value) > MAX_SPEC_BYTES:
        raise ValueError(f"has {len(value)} characters; at most {MAX_SPEC_BYTES} are taken")
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON: {str(e)[:200]}") from e


def _json_text(value: Any, what: str) -> str:
    """Canonical JSON text (sorted keys, compact): equal schemas share one compiled grammar."""
    value = _json_value(value, what)
    if json_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _json_grammar(spec: StructuredOutputs) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        spec.spec, defaults={"whitespace_flexible": not spec.disable_any_whitespace}
    )


def _json_object_grammar(spec: StructuredOutputs) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        '{"type": "object"}', defaults={"whitespace_flexible": not spec.disable_any_whitespace}
    )


def _regex_grammar(spec: StructuredOutputs) -> str:
    return llguidance.LLMatcher.grammar_from_regex(spec.spec)


def _choice_grammar(spec: StructuredOutputs) -> str:
    return llguidance.grammar_from("choice", spec.spec)


def _lark_grammar(spec: StructuredOutputs) -> str:
    return llguidance.grammar_from("grammar", spec.spec)  # Lark, or llama.cpp's GBNF (converted)


def _check_schema(text: str) -> None:
    if not isinstance(json.loads(text), (dict, bool)):
        raise ValueError("a JSON schema must be an object (or true/false)")


def _choice_text(value: Any, what: str) -> str:
    """The count is checked before the list is walked: a 60k-choice list is refused in microseconds, not after
    ~35 ms of normalizing that holds the GIL (and so stalls the server's event loop)."""
    value = _json_value(value, what)
    if isinstance(value, list) and len(value) > MAX_CHOICES:
        raise ValueError(f"has {len(value)} choices; at most {MAX_CHOICES} are taken")
    return _json_text(value, what)


def _check_choice(text: str) -> None:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"has {len(choices)} choices; at most {MAX_CHOICES} are taken")


def _check_text(text: str) -> None:
    if not text:
        raise ValueError("must be a non-empty string")


@dataclass(frozen=True)
class Kind:
    """One way to state a constraint: how its spec is normalized and checked, and its llguidance grammar."""

    grammar: Callable[[StructuredOutputs], str]
    normalize: Callable[[Any, str], str] = lambda value, what: value
    check: Callable[[str], None] = lambda text: None


# vLLM's StructuredOutputsParams fields; json_object takes no spec.
KINDS: dict[str, Kind] = {
    "json": Kind(_json_grammar, _json_text, _check_schema),
    "json_object": Kind(_json_object_grammar, lambda value, what: ""),
    "regex": Kind(_regex_grammar, check=_check_text),
    "choice": Kind(_choice_grammar, _choice_text, _check_choice),
    "grammar": Kind(_lark_grammar, check=_check_text),
}


@dataclass(frozen=True)
class StructuredOutputs:
    """The output must match `spec` of `kind` (a key of KINDS). `spec` is text, normalized: a JSON schema or a
    choice list as canonical JSON, a regex, a Lark/GBNF grammar, "" for json_object. Once the constraint is
    complete the request ends (finish_reason "stop"); max_tokens or a stop string may cut it earlier, leaving
    output that does not match (as vLLM). `field`: the request field it came from, named in errors."""

    kind: str
    spec: Any = ""
    disable_any_whitespace: bool | None = None  # JSON kinds: no whitespace between tokens; None: the engine's default
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        kind = KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"{self.field}: unknown kind {self.kind!r}; use one of {', '.join(KINDS)}")
        try:
            text = kind.normalize(self.spec, self.field)
            if not isinstance(text, str):
                raise ValueError(f"must be a string, got {type(text).__name__}")
            kind.check(text)  # first: "60000 choices; at most 1024" says more than the bytes would
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_SPEC_BYTES:
                raise ValueError(f"is {size} bytes long; at most {MAX_SPEC_BYTES} are taken")
        except (ValueError, TypeError) as e:
            raise ValueError(f"{self.field}: {e}") from e
        object.__setattr__(self, "spec", text)

    @classmethod
    def of(
        cls,
        *,
        json: Any = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        disable_any_whitespace: bool | None = None,
        field: str = "structured_outputs",
    ) -> StructuredOutputs:
        """vLLM's StructuredOutputsParams spelling: exactly one of json, regex, choice, grammar, json_object."""
        given = {"json": json, "regex": regex, "choice": choice, "grammar": grammar}
        given = {k: v for k, v in given.items() if v is not None} | ({"json_object": ""} if json_object else {})
        if len(given) != 1:
            raise ValueError(
                f"{field}: give exactly one of json, regex, choice, grammar, json_object (got {len(given)})"
            )
        ((kind, value),) = given.items()
        return cls(kind, value, disable_any_whitespace, field=f"{field}.{kind}")

    def grammar(self) -> str:
        """The llguidance grammar text (not yet checked: compiling it does that)."""
        return KINDS[self.kind].grammar(self)
