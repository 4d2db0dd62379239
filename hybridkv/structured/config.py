"""StructuredOutputsConfig: the server-wide structured-output options (vLLM's --structured-outputs-config keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "guidance")  # vLLM's names for what we run: llguidance


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    # JSON without whitespace between tokens, for requests that do not say (small models may emit whitespace
    # forever where JSON allows it).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be true or false, got {self.disable_any_whitespace!r}")

    @classmethod
    def parse(cls, raw: StructuredOutputsConfig | dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """From a JSON string or a dict; unknown keys are a ValueError naming the known ones."""
        if isinstance(raw, cls):
            return raw
        if raw is None:
            return cls()
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"structured outputs config must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown structured outputs config keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**raw)
