"""The JSON options users pass as vLLM does (`--kv-transfer-config`, `--kv-events-config`,
`--structured-outputs-config`): a JSON object string or a dict, checked key by key."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def json_object(value: str | dict[str, Any], flag: str, known: Iterable[str] | None) -> dict[str, Any]:
    """`value` parsed (when a string) into a dict whose keys are all in `known` (any keys with None); a ValueError
    names `flag` and what to change: bad JSON, not an object, or the unknown keys (with the known ones)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    if known is None:
        return value
    names = set(known)
    unknown = set(value) - names
    if unknown:
        raise ValueError(f"{flag} has unknown keys: {', '.join(sorted(unknown))}; known: {', '.join(sorted(names))}")
    return value
