"""StructuredOutputsConfig: the server-wide structured-output options (vLLM's --structured-outputs-config keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridkv.json_config import json_object

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
        raw = json_object(raw, "--structured-outputs-config", (f.name for f in fields(cls)))
        return cls(**raw)
